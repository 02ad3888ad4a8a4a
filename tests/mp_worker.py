"""One process of the 2-process data-parallel test (tests/test_multiprocess.py); also its reference.

Run as `python tests/mp_worker.py OUT.npz` with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID set (one CPU device per process): it joins the job through
`posttrain.sharding.init_distributed`, builds a dp mesh over both processes' devices, feeds its
own half of the global batch, runs STEPS SFT steps from the same seed and writes its losses and
final parameters to OUT.npz. `run(None)` is the same training on one device, for the reference.
"""

from __future__ import annotations

import sys

STEPS = 5
GLOBAL_BATCH = 8
SEQ = 16
TINY = dict(vocab_size=128, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)


def tiny_model():
    """The tiny model with weights drawn by numpy (seed 0): the same in every process, and no
    per-op XLA compilations for an eager initialiser (seconds each on the 2-core test machines)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from posttrain.models import Transformer, preset

    cfg = preset("tiny-llama", **TINY)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)

    def fill(v):
        value = rng.normal(0, 0.02, v.shape) if len(v.shape) > 1 else 1.0 + rng.normal(0, 0.1, v.shape)
        return v.replace(jnp.asarray(value, v.dtype))

    state = jax.tree.map(fill, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


def global_batch():
    import numpy as np

    from posttrain.data import Example, to_arrays

    rng = np.random.default_rng(0)
    ex = []
    for i in range(GLOBAL_BATCH):
        L = int(rng.integers(4, SEQ + 1))
        ids = rng.integers(3, TINY["vocab_size"], L).astype(np.int32)
        ex.append(Example(ids=ids, loss_mask=(np.arange(L) >= L // 3).astype(np.int32), where=f"row {i}"))
    return to_arrays(ex, SEQ, 0, packing=False)


def run(mesh_preset=None):
    """(losses [STEPS], {dotted param path: array}) of the training; sharded when a preset is given."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from posttrain import sharding as sh
    from posttrain.losses import sft_loss
    from posttrain.train import init_state, make_train_step

    opt = optax.adamw(1e-3, eps=1e-5)  # eps: see tests/test_sharding.py::_sft_builder
    graphdef, state = init_state(tiny_model(), opt)
    step = make_train_step(sft_loss, opt, graphdef)
    batch = global_batch()
    losses = []
    if mesh_preset is None:
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        for _ in range(STEPS):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
    else:
        mesh, rules = sh.make_mesh(mesh_preset), sh.preset_rules(mesh_preset)
        n, i = jax.process_count(), jax.process_index()
        rows = GLOBAL_BATCH // n
        local = {k: v[i * rows:(i + 1) * rows] for k, v in batch.items()}  # this process's shard
        state = sh.shard_state(state, mesh, rules)
        batch = sh.shard_batch(local, mesh, rules)
        assert batch["tokens"].shape == (GLOBAL_BATCH, SEQ)
        with sh.use_mesh(mesh, rules):
            for _ in range(STEPS):
                state, m = step(state, batch)
                losses.append(float(m["loss"].addressable_data(0)))  # replicated: read the local copy
    params = {".".join(map(str, p)): np.asarray(v[...].addressable_data(0) if mesh_preset else v[...])
              for p, v in nnx.to_flat_state(state.params)}
    return np.array(losses), params


def main(out: str) -> None:
    import time

    t0 = time.perf_counter()
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from posttrain import sharding as sh

    assert sh.init_distributed(), "JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID not set"
    assert jax.process_count() == 2 and jax.local_device_count() == 1 and jax.device_count() == 2
    import numpy as np

    t1 = time.perf_counter()
    losses, params = run("dp")
    print(f"process {jax.process_index()}: start {t1 - t0:.1f} s, train {time.perf_counter() - t1:.1f} s, "
          f"losses {losses.tolist()}", flush=True)
    checksum = float(sum(np.abs(p.astype(np.float64)).sum() for p in params.values()))
    np.savez(out, losses=losses, checksum=checksum, process=jax.process_index(),
             **{"param:" + k: v for k, v in params.items()})


if __name__ == "__main__":
    main(sys.argv[1])

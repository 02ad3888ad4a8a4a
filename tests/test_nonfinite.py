"""The NaN guard: a non-finite step is skipped and counted; a run of them halts with the last good checkpoint.

Kills, signals, failed writes, corrupt checkpoints and concurrent runs, for every trainer:
tests/reliability/test_faults.py."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from posttrain import config as C
from posttrain.errors import PosttrainError
from posttrain.trainers.sft import SFTTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "sft_prompt_completion.jsonl")
ARGS = ["model.preset=demo-tiny", f"data.train={DATA}", "data.max_length=32", "train.steps=12",
        "train.batch_size=4", "train.log_every=1", "checkpoint.every=3", "checkpoint.keep=2",
        "metrics.sinks=[jsonl]", "optim.lr=1e-3"]


def _config(run_dir, **over):
    overrides = ARGS + [f"run_dir={run_dir}"] + [f"{k}={v}" for k, v in over.items()]
    return C.load(C.SFTConfig, None, overrides)


def test_the_guard_leaves_a_finite_run_bitwise_alone(tmp_path, monkeypatch):
    """30 SFT steps (clipping on, as by default) with the guard and without it end with the same bits. The tenth
    stop's guard, the update inside a `lax.cond` branch, failed this: with clipping on it moved a run's last bits
    (without clipping the two forms agreed) and `posttrain demo`'s table with them (docs/testing.md)."""
    import functools

    from flax import nnx

    import posttrain.recipes.recipe as recipe_mod
    from posttrain.train import make_train_step

    def run(name):
        trainer = SFTTrainer(_config(tmp_path / name, **{"train.steps": 30, "checkpoint.every": 1000,
                                                          "metrics.sinks": "[]"}), progress=False)
        trainer.train()
        return [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.model))]

    guarded = run("guarded")
    monkeypatch.setattr(recipe_mod, "make_train_step", functools.partial(make_train_step, nonfinite_guard=False))
    plain = run("plain")
    assert len(guarded) == len(plain)
    assert all(np.array_equal(a, b) for a, b in zip(guarded, plain))


def test_nonfinite_step_is_skipped_and_counted():
    from flax import nnx

    from posttrain.models import Transformer, preset
    from posttrain.train import init_state, make_train_step

    model = Transformer(preset("demo-tiny"), rngs=nnx.Rngs(0))

    def loss(policy, batch, *, frozen=None, rng=None):
        out = policy(batch["tokens"], batch["positions"]).logits
        total = jnp.sum(out[..., 0] * batch["weights"]) * batch["scale"][0]
        return total, {"denom": jnp.sum(batch["weights"]), "loss": total}

    opt = optax.adam(1e-2)
    graphdef, state = init_state(model, opt)
    step = make_train_step(loss, opt, graphdef)
    batch = {"tokens": jnp.ones((2, 4), jnp.int32), "positions": jnp.broadcast_to(jnp.arange(4), (2, 4)),
             "weights": jnp.ones((2, 4)), "scale": jnp.ones((2,))}
    before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    state, m = step(state, dict(batch, scale=jnp.full((2,), jnp.nan)))
    assert float(m["skipped"]) == 1.0 and int(state.nonfinite) == 1
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(state.params)))
    state, m = step(state, batch)
    assert float(m["skipped"]) == 0.0 and int(state.nonfinite) == 0
    assert not all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(state.params)))


def test_nan_run_halts_with_last_good_checkpoint_intact(tmp_path, monkeypatch):
    """From step 5 on every batch has NaN loss weights: 2 skipped steps in a row halt the run."""
    import posttrain.trainers.sft as sft_mod

    real_batches = sft_mod.batches
    monkeypatch.setattr(sft_mod, "batches", lambda *a, **kw: _StatefulNaN(real_batches(*a, **kw), from_index=4))
    run_dir = str(tmp_path / "run")
    trainer = SFTTrainer(_config(run_dir, **{"checkpoint.async_save": "false", "train.max_nonfinite": 2}),
                         progress=False)
    with pytest.raises(PosttrainError, match="NaN/Inf in 2 consecutive steps"):
        trainer.train()
    steps = sorted(int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit())
    assert steps == [3]  # the last good checkpoint, written before the NaNs
    assert not os.path.exists(os.path.join(run_dir, "trainable.safetensors"))


class _StatefulNaN:
    """A Grain dataset wrapper whose iterator turns every batch from `from_index` on into NaN weights."""

    def __init__(self, ds, from_index):
        self.ds, self.from_index = ds, from_index

    def __iter__(self):
        return _NaNIter(iter(self.ds), self.from_index)


class _NaNIter:
    def __init__(self, it, from_index):
        self.it, self.from_index, self.i = it, from_index, 0

    def __iter__(self):
        return self

    def __next__(self):
        b = next(self.it)
        self.i += 1
        if self.i > self.from_index:
            b = dict(b, weights=np.full_like(b["weights"], np.nan))
        return b

    def get_state(self):
        return self.it.get_state()

    def set_state(self, s):
        self.it.set_state(s)

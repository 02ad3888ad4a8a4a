"""The learning-rate schedule as arguments of the train step (posttrain.train.optim.Schedule / Optimizer).

The reference is optax's own schedule functions with Python numbers, as the step closed over them before: jitted,
their numbers are constants of the program. The new step takes the numbers as arguments (one compiled program for
runs that differ only in their length or LR) and must give the same learning rate at every count, bitwise, and the
same parameters after a few AdamW steps. The optimizer state must stay optax's pytree (old checkpoints restore).
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain.config import OptimSection
from posttrain.data import Example, to_arrays
from posttrain.losses import sft_loss
from posttrain.models import Transformer, preset
from posttrain.recipes.critic import ppo_optimizer
from posttrain.train import init_state, make_optimizer, make_train_step, schedule
from posttrain.train.optim import decay_mask

TINY = dict(vocab_size=97, embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)


def optax_reference(cfg, total_steps):
    """The schedule from optax's functions, written out here (not the library's code)."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    decay = max(1, total_steps - cfg.warmup_steps)
    main = {"constant": lambda: optax.constant_schedule(peak),
            "linear": lambda: optax.linear_schedule(peak, floor, decay),
            "cosine": lambda: optax.cosine_decay_schedule(peak, decay, alpha=cfg.min_lr_ratio)}[cfg.schedule]()
    if cfg.warmup_steps <= 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, peak, cfg.warmup_steps), main], [cfg.warmup_steps])


def reference_chain(cfg, lr):
    """The optax chain the library built before: clipping, AdamW with decay masked off norms and biases."""
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                       optax.adamw(lr, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                   mask=decay_mask))


KINDS = [("cosine", 0.0), ("cosine", 0.1), ("linear", 0.0), ("linear", 0.05), ("constant", 0.0)]


@pytest.mark.parametrize("kind,ratio", KINDS)
@pytest.mark.parametrize("warmup", [0, 7])
def test_each_count_equals_optax_compiled_with_constants(kind, ratio, warmup):
    at = jax.jit(lambda s, c: s(c))  # one program per kind: the numbers are arguments
    for total, lr in ((1, 1e-3), (40, 1.5e-3), (57, 3e-5)):
        cfg = OptimSection(lr=lr, schedule=kind, warmup_steps=warmup, min_lr_ratio=ratio)
        ref, sched = optax_reference(cfg, total), schedule(cfg, total)
        compiled = jax.jit(lambda c: ref(c))  # noqa: B023 (called in this iteration only)
        counts = range(total + 3)
        want = np.array([compiled(jnp.int32(c)) for c in counts], np.float32)
        got = np.array([at(sched, jnp.int32(c)) for c in counts], np.float32)
        np.testing.assert_array_equal(got, want, err_msg=f"{cfg} over {total} steps")
        # and optax's formula evaluated op by op: XLA's folding moves the last bit, never more than 2 ulp of lr
        eager = np.array([ref(jnp.int32(c)) for c in counts], np.float32)
        assert np.abs(got - eager).max() <= 2 * np.spacing(np.float32(lr)), (cfg, total, got - eager)


def _state_and_batch(opt):
    graphdef, state = init_state(Transformer(preset("tiny-llama", **TINY), rngs=nnx.Rngs(0)), opt)
    rng = np.random.default_rng(0)
    rows = [Example(ids=rng.integers(3, 97, 12).astype(np.int32), loss_mask=np.ones(12, np.int32), where=str(i))
            for i in range(4)]
    return graphdef, state, {k: jnp.asarray(v) for k, v in to_arrays(rows, 16, 0, packing=False).items()}


def test_train_steps_equal_the_constant_number_step_bitwise():
    cfg = OptimSection(lr=3e-3, schedule="cosine", warmup_steps=3, min_lr_ratio=0.1, weight_decay=0.01)
    total = 8
    ref_lr = optax_reference(cfg, total)
    runs = {}
    for name, opt, lr in (("constants", reference_chain(cfg, ref_lr), ref_lr),
                          ("arguments", make_optimizer(cfg, schedule(cfg, total)), schedule(cfg, total))):
        graphdef, state, batch = _state_and_batch(opt)
        step = make_train_step(sft_loss, opt, graphdef, schedule=lr)
        logged = []
        for _ in range(total):
            state, m = step(state, batch)
            logged.append([float(m[k]) for k in ("lr", "loss", "grad_norm")])
        runs[name] = (logged, jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state))
    (lr_a, p_a, o_a), (lr_b, p_b, o_b) = runs["constants"], runs["arguments"]
    assert lr_a == lr_b and lr_a[0][0] == 0.0 and lr_a[4][0] != lr_a[5][0]
    for a, b in zip(p_a + o_a, p_b + o_b):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_runs_of_other_lengths_and_lrs_lower_one_program():
    texts = {}
    for total, lr in ((10, 1e-3), (50, 1e-3), (50, 2e-4)):
        cfg = OptimSection(lr=lr, schedule="cosine", warmup_steps=5)
        opt = make_optimizer(cfg, schedule(cfg, total))
        graphdef, state, batch = _state_and_batch(opt)
        texts[total, lr] = make_train_step(sft_loss, opt, graphdef, schedule=schedule(cfg, total)).lower(
            state, batch).as_text()
    assert texts[10, 1e-3] == texts[50, 1e-3] == texts[50, 2e-4]
    # the check can fail: with the numbers as constants the lengths lower two programs
    cfg = OptimSection(lr=1e-3, schedule="cosine", warmup_steps=5)
    consts = []
    for total in (10, 50):
        opt = reference_chain(cfg, optax_reference(cfg, total))
        graphdef, state, batch = _state_and_batch(opt)
        consts.append(make_train_step(sft_loss, opt, graphdef).lower(state, batch).as_text())
    assert consts[0] != consts[1]


def test_optimizer_state_is_optax_pytree_so_old_checkpoints_restore():
    cfg = OptimSection(lr=1e-3, schedule="linear", warmup_steps=2)
    params = {"critic": {"w": jnp.ones((2, 3))}, "layers": {"w": jnp.ones((3,)), "attn_norm": jnp.ones((3,))}}
    new = make_optimizer(cfg, schedule(cfg, 20)).init(params)
    old = reference_chain(cfg, optax_reference(cfg, 20)).init(params)
    assert jax.tree.structure(new) == jax.tree.structure(old)
    # PPO: the policy's and the critic's chains under optax.multi_transform, as before
    c = types.SimpleNamespace(optim=cfg, ppo=types.SimpleNamespace(critic_lr=5e-4), train=types.SimpleNamespace(
        steps=20))
    labels = {"critic": {"w": "critic"}, "layers": {"w": "policy", "attn_norm": "policy"}}
    critic = OptimSection(lr=5e-4, schedule="linear", warmup_steps=2)
    old_ppo = optax.multi_transform({"policy": reference_chain(cfg, optax_reference(cfg, 20)),
                                     "critic": reference_chain(critic, optax_reference(critic, 20))}, labels)
    assert jax.tree.structure(ppo_optimizer(c).init(params)) == jax.tree.structure(old_ppo.init(params))

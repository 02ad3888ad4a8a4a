"""Rematerialisation, matmul precision and a bfloat16 state: a remat layer's gradients equal the plain
layer's under each policy, with full weights and with LoRA (adapters trainable, base frozen, dropout's RNG advancing
as without remat); `ModelConfig.matmul_precision` reaches every matmul of the forward; a bfloat16 state keeps its
dtypes across steps."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain.data import Example, to_arrays
from posttrain.errors import PosttrainError
from posttrain.losses import sft_loss
from posttrain.models import Transformer, preset
from posttrain.models.lora import LoraParam, apply_lora
from posttrain.train import init_state, make_train_step

TINY = dict(vocab_size=97, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)


def _batch():
    rng = np.random.default_rng(3)
    rows = [Example(ids=rng.integers(3, 97, n).astype(np.int32), loss_mask=np.ones(n, np.int32), where=f"row {i}")
            for i, n in enumerate((9, 14, 5, 12))]
    return {k: jnp.asarray(v) for k, v in to_arrays(rows, 16, 0, packing=False).items()}


def _model(lora: bool, dropout: float = 0.0, **cfg):
    m = Transformer(preset("tiny-llama", **TINY, **cfg), rngs=nnx.Rngs(0))
    if lora:
        apply_lora(m, rank=4, dropout=dropout, seed=1)
        for _, mod in nnx.iter_modules(m):  # adapters B start at zero: give them values so A's gradient is not 0
            if hasattr(mod, "b") and isinstance(mod.b, LoraParam):
                mod.b[...] = 0.1 * jax.random.normal(jax.random.key(2), mod.b[...].shape)
    return m


def _steps(lora: bool, remat: bool, policy: str = "full", dropout: float = 0.0, n: int = 2):
    """n SGD steps; returns (losses, grad norms, the trainable params after)."""
    model = _model(lora, dropout, remat=remat, remat_policy=policy)
    opt = optax.sgd(0.1)
    graphdef, state = init_state(model, opt, trainable=LoraParam if lora else nnx.Param)
    step = make_train_step(sft_loss, opt, graphdef, trainable=LoraParam if lora else nnx.Param)
    batch, out = _batch(), []
    for _ in range(n):
        state, m = step(state, batch)
        out.append((float(m["loss"]), float(m["grad_norm"])))
    return out, state.params


SLOW = pytest.mark.slow  # make test-fast keeps one case: LoRA under the dots policy


@pytest.mark.parametrize("lora,dropout,policy", [
    pytest.param(False, 0.0, "full", marks=SLOW), (True, 0.0, "dots"), pytest.param(False, 0.0, "dots", marks=SLOW),
    pytest.param(True, 0.0, "full", marks=SLOW), pytest.param(True, 0.2, "full", marks=SLOW),
    pytest.param(True, 0.2, "dots", marks=SLOW)])
def test_remat_steps_equal_plain_steps(lora, dropout, policy):
    """Two train steps with remat equal two without (losses, grad norms, weights; round-off only), LoRA included
    (before the functional remat, LoRA + remat raised TraceContextError). With dropout the masks drawn in the
    recomputed forward are the forward's own (the same loss as without remat), and the RNG state advances."""
    ref, p_ref = _steps(lora, False, dropout=dropout)
    got, p_got = _steps(lora, True, policy, dropout=dropout)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(p_got), jax.tree.leaves(p_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    if dropout:  # the masks were drawn: the loss differs from the same steps without dropout
        assert abs(got[0][0] - _steps(lora, False)[0][0][0]) > 1e-4


def test_remat_policy_and_precision_are_checked():
    with pytest.raises(PosttrainError, match="remat_policy"):
        preset("tiny-llama", remat_policy="some")
    with pytest.raises(PosttrainError, match="matmul_precision"):
        preset("tiny-llama", matmul_precision="exact")


@pytest.mark.parametrize("precision", [None, "highest"])
def test_matmul_precision_reaches_every_matmul(precision):
    """`matmul_precision: highest` puts HIGHEST on every dot of the forward (what keeps float32 exact on a TPU,
    whose default runs float32 operands through bfloat16 passes); None leaves JAX's default on each."""
    model = _model(False, matmul_precision=precision)
    tok = jnp.ones((2, 8), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    with jax.default_matmul_precision("default"):  # whatever the process's default (the TPU tier sets highest)
        jaxpr = jax.make_jaxpr(lambda t, p: model(t, p).logits)(tok, pos)

    def dots(jx):
        for e in jx.eqns:
            if e.primitive.name == "dot_general":
                yield e.params["precision"]
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                yield from dots(sub)

    found = list(dots(jaxpr.jaxpr))
    assert len(found) >= 2 * TINY["num_layers"] * 3  # the projections, attention and MLP of each layer
    highest = [p is not None and jax.lax.Precision.HIGHEST in tuple(p) for p in found]
    assert all(highest) if precision == "highest" else not any(highest)


def test_bfloat16_state_keeps_its_dtypes():
    """bfloat16 parameters: the step's new state has the old one's dtypes (the gradients are not promoted by the
    float32 token count, so AdamW's moments stay bfloat16), and a second step reuses the first's executable."""
    model = Transformer(preset("tiny-llama", **TINY, param_dtype="bfloat16", dtype="bfloat16"), rngs=nnx.Rngs(0))
    opt = optax.adamw(1e-3)
    graphdef, state = init_state(model, opt)
    step = make_train_step(sft_loss, opt, graphdef)
    before = [x.dtype for x in jax.tree.leaves(state)]
    state, _ = step(state, _batch())
    assert [x.dtype for x in jax.tree.leaves(state)] == before
    state, _ = step(state, _batch())
    assert step._cache_size() == 1

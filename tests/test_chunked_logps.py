"""Chunked vocabulary log-probs (`losses/logps.token_logps`): with a budget that forces chunks (and padding)
the log-probs, entropies and parameter gradients equal the unchunked computation, and the chunked program
never holds a [B, M, V] array (checked on the jaxpr of the gradient, scan bodies included)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.losses.logps import chunk_len, token_logps
from posttrain.models import Transformer, preset

B, M, V = 3, 37, 512


def _model():
    return Transformer(preset("demo-tiny", vocab_size=V), rngs=nnx.Rngs(0))


def _inputs(model):
    h = jax.random.normal(jax.random.key(1), (B, M, model.cfg.embed_dim), jnp.float32)
    tgt = jax.random.randint(jax.random.key(2), (B, M), 0, V)
    w = (jax.random.uniform(jax.random.key(3), (B, M)) > 0.3).astype(jnp.float32)
    return h, tgt, w


def _loss(budget):
    def f(model, h, tgt, w):
        lp, ent = token_logps(model, h, tgt, temperature=0.7, with_entropy=True, budget=budget)
        return jnp.sum(lp * w) + 0.1 * jnp.sum(ent * w), (lp, ent)
    return f


def test_chunk_len_splits_evenly_under_the_budget():
    assert chunk_len(2, 100, 10, budget=2000) == 100  # fits: one chunk
    c = chunk_len(8, 128, 49152)  # SmolLM2's vocabulary, a GRPO batch of 8 rows x 8 x 16 tokens
    assert 8 * c * 49152 <= 1 << 24 and 128 % c == 0
    c = chunk_len(B, M, V, budget=B * 10 * V)
    assert c <= 10 and -(-M // c) * c - M < -(-M // c)  # padding below one position per chunk


def test_chunked_equals_unchunked_values_and_gradients():
    model = _model()
    h, tgt, w = _inputs(model)
    small = B * 8 * V  # chunks of <= 8 positions: 5 chunks, 3 padded positions
    assert chunk_len(B, M, V, budget=small) < M
    outs = {}
    for name, budget in (("full", 1 << 30), ("chunked", small)):
        # one compiled program each (op by op: ~110 small compiles)
        grad_fn = nnx.jit(nnx.value_and_grad(_loss(budget), argnums=(0, 1), has_aux=True))
        (val, (lp, ent)), (g_model, g_h) = grad_fn(model, h, tgt, w)
        outs[name] = (val, lp, ent, jax.tree.leaves(nnx.state(g_model, nnx.Param)), g_h)
    (v0, lp0, e0, gm0, gh0), (v1, lp1, e1, gm1, gh1) = outs["full"], outs["chunked"]
    np.testing.assert_allclose(lp1, lp0, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(e1, e0, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    np.testing.assert_allclose(gh1, gh0, rtol=1e-5, atol=1e-6)
    assert len(gm0) == len(gm1) and any(float(jnp.abs(g).max()) > 0 for g in gm0)
    for a, b in zip(gm0, gm1):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def _shapes(jaxpr):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield tuple(getattr(v.aval, "shape", ()))
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", None)
            if inner is not None:
                yield from _shapes(getattr(inner, "jaxpr", inner))


def test_chunked_gradient_never_holds_the_whole_logits():
    model = _model()
    h, tgt, w = _inputs(model)
    graphdef, params = nnx.split(model)

    def loss(params, budget):
        return _loss(budget)(nnx.merge(graphdef, params), h, tgt, w)[0]

    def biggest_vocab_array(budget):
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss(p, budget)))(params).jaxpr
        weights = {tuple(x.shape) for x in jax.tree.leaves(params)}
        return max(int(np.prod(s)) for s in _shapes(jaxpr) if s not in weights and len(s) >= 3 and s[-1] == V)

    assert biggest_vocab_array(1 << 30) >= B * M * V  # the check sees the whole-batch logits when they exist
    assert biggest_vocab_array(B * 8 * V) <= B * 8 * V

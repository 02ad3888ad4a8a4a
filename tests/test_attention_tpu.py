"""The TPU splash-attention path (models/attention_tpu.py) equals the dense reference, outputs and gradients, on
the layouts it takes (causal, right padding, packed segments, soft-capping, grouped-query heads, a length that is
not a multiple of the tile), run here through Pallas's interpreter on a CPU; `choose` sends only those layouts
to it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import ATOL, B, G, H, K, _layout

from posttrain.models import attention as A

CASES = {"causal": (dict(), None), "padded": (dict(pad=[150, 77]), None),
         "segments": (dict(segments=[[1] * 90 + [2] * 60 + [0] * 50, [1] * 200]), None),
         "softcap": (dict(pad=[200, 130]), 5.0)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in ("causal", "padded") else c
                                  for c in CASES])  # make test-fast: segments and soft-cap (padding included)
def test_splash_equals_dense(case):
    T = 200  # padded to 256 inside: one 256 tile
    over, cap = CASES[case]
    lay = _layout(T, **over)
    r = np.random.default_rng(1)
    q = jnp.asarray(r.normal(size=(B, T, K, G, H)), jnp.float32) * 2  # scores ~ 8: the cap bites
    k = jnp.asarray(r.normal(size=(B, K, T, H)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, K, T, H)), jnp.float32)
    w = jnp.asarray(r.normal(size=(B, T, K, G, H)), jnp.float32)
    real = (lay.q_pos >= 0)[:, :, None, None, None]

    def loss(impl, q, k, v):
        out, _ = A.attention(q, k, v, lay, window=None, scale=H ** -0.5, cap=cap, impl=impl)
        return jnp.sum(jnp.where(real, out, 0) * w), out

    (l_ref, o_ref), g_ref = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)("dense", q, k, v)
    impl = "splash" if jax.default_backend() == "tpu" else "splash_interpret"  # the kernel itself on a TPU
    (l_got, o_got), g_got = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(impl, q, k, v)
    np.testing.assert_allclose(np.asarray(o_got), np.asarray(o_ref), atol=2 * ATOL)
    for a, b in zip(g_got, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5 * ATOL)


def test_choose_tpu():
    kw = dict(T=2048, S=2048, branches=False, softcap=False, cached=False)
    assert A.choose("tpu", **kw) == "splash"
    assert A.choose("tpu", **{**kw, "softcap": True}) == "splash"
    assert A.choose("tpu", **{**kw, "branches": True}) == "blockwise"
    assert A.choose("tpu", **{**kw, "cached": True}) == "blockwise"
    assert A.choose("tpu", window=True, **kw) == "blockwise"
    assert A.choose("tpu", sinks=True, **{**kw, "softcap": True}) == "blockwise"
    assert A.choose("tpu", **{**kw, "T": 1}) == "dense"


def test_splash_kernel_reused_across_traces():
    """The kernel (cached per shape) is built from concrete mask data: two jitted programs and a scan over
    micro-batches with the same shape reuse it without leaking a tracer from the first trace."""
    lay = _layout(200, pad=[150, 77])
    r = np.random.default_rng(2)
    q = jnp.asarray(r.normal(size=(B, 200, K, G, H)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, K, 200, H)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, K, 200, H)), jnp.float32)
    impl = "splash" if jax.default_backend() == "tpu" else "splash_interpret"

    def f(q, k, v):
        return A.attention(q, k, v, lay, window=None, scale=H ** -0.5, cap=None, impl=impl)[0]

    a = jax.jit(f)(q, k, v)
    b = jax.jit(lambda q, k, v: jax.lax.scan(lambda c, x: (c, f(*x)), 0, (q[None], k[None], v[None]))[1][0])(q, k, v)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.slow
def test_long_rows_take_the_long_tile_and_equal_dense(monkeypatch):
    """Rows of LONG slots or more are tiled by LONG_BLOCK (1024 for 8192+ on a TPU); here LONG is lowered to 1024 so
    a 1000-token row (padded to 1024) is one 1024-tile where BLOCKS alone would give two 512-tiles, and the
    kernel so tiled still equals dense attention, outputs and gradients (float32 inputs: LONG_F32 lets them take it).
    Float32 inputs by default keep BLOCKS."""
    from posttrain.models import attention_tpu as AT

    monkeypatch.setattr(AT, "LONG", 1024)
    AT._kernel.cache_clear()
    assert AT._kernel(1024, G, None, True, wide=False).kwargs["block_sizes"].block_q == 512  # float32's rule
    monkeypatch.setattr(AT, "LONG_F32", True)
    AT._kernel.cache_clear()
    try:
        assert AT._kernel(1024, G, None, True).kwargs["block_sizes"].block_q == 1024
        assert AT._kernel(896, G, None, True).kwargs["block_sizes"].block_q == 128  # below LONG: BLOCKS
        T = 1000
        lay = _layout(T, pad=[1000, 700])
        r = np.random.default_rng(3)
        q = jnp.asarray(r.normal(size=(B, T, K, G, H)), jnp.float32)
        k = jnp.asarray(r.normal(size=(B, K, T, H)), jnp.float32)
        v = jnp.asarray(r.normal(size=(B, K, T, H)), jnp.float32)
        real = (lay.q_pos >= 0)[:, :, None, None, None]

        def loss(impl, q, k, v):
            out, _ = A.attention(q, k, v, lay, window=None, scale=H ** -0.5, cap=None, impl=impl)
            return jnp.sum(jnp.where(real, out, 0) ** 2), out

        (_, o_ref), g_ref = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)("dense", q, k, v)
        impl = "splash" if jax.default_backend() == "tpu" else "splash_interpret"
        (_, o_got), g_got = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(impl, q, k, v)
        np.testing.assert_allclose(np.asarray(o_got), np.asarray(o_ref), atol=2 * ATOL)
        for a, b in zip(g_got, g_ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5 * ATOL)
    finally:
        AT._kernel.cache_clear()  # kernels built under the lowered LONG must not serve later tests

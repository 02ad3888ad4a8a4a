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


def test_choose_tpu(monkeypatch):
    kw = dict(T=2048, S=2048, branches=False, softcap=False, cached=False)
    assert A.choose("tpu", **kw) == "splash"
    assert A.choose("tpu", **{**kw, "softcap": True}) == "splash"
    assert A.choose("tpu", **{**kw, "branches": True}) == "blockwise"
    assert A.choose("tpu", **{**kw, "cached": True}) == "blockwise"
    assert A.choose("tpu", window=True, **kw) == "blockwise"
    assert A.choose("tpu", sinks=True, **{**kw, "softcap": True}) == "blockwise"
    assert A.choose("tpu", **{**kw, "T": 1}) == "dense"
    one = {**kw, "T": 1, "cached": True}  # a decode step against a cache: dense, or the Pallas kernel when asked
    assert A.choose("tpu", **one) == "dense"
    monkeypatch.setattr(A, "DECODE_KERNEL", True)
    assert A.choose("tpu", **one) == "decode"
    assert A.choose("tpu", window=True, **{**one, "softcap": True}) == "decode"
    assert A.choose("tpu", **{**one, "branches": True}) == "dense"  # prefix-shared rows, sinks, images: dense
    assert A.choose("tpu", sinks=True, **{**one, "softcap": True}) == "dense"
    assert A.choose("tpu", images=True, **one) == "dense"
    assert A.choose("tpu", return_probs=True, **one) == "dense"
    assert A.choose("cpu", **one) == "dense"


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


# (dtype, pack: heads a cache row holds, window, cap, blocks: (rows, slots) a grid step or None for decode_blocks)
DECODE = {"f32": (jnp.float32, 1, None, None, None), "packed": (jnp.float32, 4, None, None, (2, 128)),
          "window_cap": (jnp.float32, 2, 40, 5.0, (3, 128)), "one_block": (jnp.float32, 2, None, None, (6, 300)),
          "bf16": (jnp.bfloat16, 4, None, None, (1, 128)), "float8": (jnp.bfloat16, 2, None, None, (2, 256))}


@pytest.mark.parametrize("case", list(DECODE))
def test_decode_kernel_equals_dense(case):
    """One query a row against a cache of 300 slots filled to slot 200 (so the blocks after it are skipped and a
    128-slot grid's last block runs past the cache), left padding of 0-28 slots, a row with no key at all: the
    Pallas decode kernel (interpreted on a CPU) equals `dense` on the same cache, packed P heads a row or not."""
    dt, P, window, cap, blocks = DECODE[case]
    Bd, Kd, Gd, Hd, S, idx = 6, 4, 3, 32, 300, 200
    r = np.random.default_rng(3)
    q = jnp.asarray(r.normal(size=(Bd, 1, Kd, Gd, Hd)) * 2, dt)  # scores ~ 8: a cap of 5 bites
    k = jnp.asarray(r.normal(size=(Bd, Kd, S, Hd)), dt)
    v = jnp.asarray(r.normal(size=(Bd, Kd, S, Hd)), dt)
    if case == "float8":  # a float8 cache: the kernel casts it as dense does
        k, v = k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn)
    pos = np.full((Bd, S), -1, np.int32)
    for b in range(Bd - 1):
        pos[b, 7 * b:idx + 1] = np.arange(idx + 1 - 7 * b)
    lay = A.Layout(jnp.asarray(pos[:, idx:idx + 1]), jnp.asarray(pos), jnp.asarray([idx], jnp.int32),
                   jnp.arange(S, dtype=jnp.int32))
    ref, _ = A.attention(q, A.pack_heads(k, P), A.pack_heads(v, P), lay, window=window, scale=Hd ** -0.5, cap=cap,
                         impl="dense")
    from posttrain.models.attention_tpu import decode

    interpret = jax.default_backend() != "tpu"  # the kernel itself on a TPU
    got = decode(q, A.pack_heads(k, P), A.pack_heads(v, P), lay, scale=Hd ** -0.5, cap=cap, window=window,
                 interpret=interpret, blocks=blocks)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    tol = 2 * ATOL if dt == jnp.float32 else 2e-2  # bfloat16: dense rounds its scores to bfloat16, the kernel not
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=tol)
    assert not np.asarray(got[-1]).any()  # the row with no key outputs zeros
    if window is not None:  # the window bites: without it the outputs differ
        far = decode(q, A.pack_heads(k, P), A.pack_heads(v, P), lay, scale=Hd ** -0.5, cap=cap, window=None,
                     interpret=interpret, blocks=blocks)
        assert np.abs(np.asarray(far) - np.asarray(got)).max() > 1e-2


def test_decode_blocks():
    """Slots: 128 a step (all of a shorter cache); rows: the largest divisor of B within DECODE_BYTES of keys."""
    from posttrain.models.attention_tpu import DECODE_BYTES, decode_blocks

    assert DECODE_BYTES == 4 << 20  # the numbers below are for 4 MiB
    assert decode_blocks(256, 4, 640, 128, 2) == (32, 128)  # 128 KiB a row: 32 rows
    assert decode_blocks(64, 4, 100, 128, 2) == (32, 100)  # 100 KiB a row: at most 40, the largest divisor 32
    assert decode_blocks(6, 4, 640, 128, 2) == (6, 128)
    assert decode_blocks(257, 4, 640, 128, 1) == (1, 128)  # 257 is prime (64 KiB a row: at most 64)

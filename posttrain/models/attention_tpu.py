"""Attention on a TPU through JAX's Pallas splash-attention kernel (`jax.experimental.pallas.ops.tpu`).

Used by `attention.attention` for the training layouts it expresses: causal rows without a cache, with packed
segments, padding, grouped-query heads and tanh soft-capping. It is not used for prefix-shared rows (branches),
sliding windows (the kernel's window is by slot, posttrain's by position), attention sinks or a KV cache: those
stay on `attention.blockwise`. Splash keeps no [T, S] tensor (its backward recomputes tiles from the saved
log-sum-exp, as FlashAttention-2) and skips the tiles above the causal diagonal.

Numerics: the kernel scores in float32 from q pre-multiplied by the scale in q's dtype, so in bfloat16 it equals
`attention.dense` to bfloat16 round-off; `interpret=True` runs the same kernel on a CPU (tests/test_attention_tpu.py).
Queries with no key to attend (padding) output zeros, as `dense` does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BLOCKS = (512, 256, 128)  # the largest that divides the padded length is the tile; rows are padded to 128
# rows of LONG or more slots take 1024-tiles when they divide the row: llama3-1b, 1 x 8192, dots remat on a v5e chip,
# 47.4 % MFU against 43.8 % with 512-tiles (docs/benchmarks.md, TPU fifth session); shorter rows keep BLOCKS (their
# 55.5 % MFU was measured with 512)
LONG, LONG_BLOCK = 8192, 1024
# ... for 16-bit inputs only: float32 rows of 16,384 slots at HIGHEST matmul precision (the TPU test tier's setting)
# with 1024-tiles fail to compile on a v5e ("CompileTimeScopedVmemOom": the dkv kernel's scoped VMEM 20.25M against
# its 16M limit, docs/benchmarks.md, TPU eighth session), so float32 keeps BLOCKS. True: float32 takes them too.
LONG_F32 = False


@functools.lru_cache(maxsize=32)
def _kernel(T: int, groups: int, cap, interpret: bool, wide: bool = True):
    """The splash kernel for rows of T (a multiple of 128) slots and `groups` query heads per kv head; wide: rows of
    LONG or more may take LONG_BLOCK tiles (16-bit inputs)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b = next(x for x in ((LONG_BLOCK,) if wide and T >= LONG else ()) + BLOCKS if T % x == 0)
    sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                          block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    mask = sm.MultiHeadMask([sm.CausalMask((T, T)) for _ in range(groups)])
    # concrete mask data even when first asked for inside a trace: the kernel is cached and reused by other traces
    with jax.ensure_compile_time_eval():
        return sk.make_splash_mqa(mask, block_sizes=sizes, attn_logits_soft_cap=cap, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def splash(q, k, v, layout, *, scale: float, cap, interpret: bool = False):
    """q [B,T,K,G,H]; k, v [B,K,T,H]; a `Layout` without a cache (causal_aligned), branches or window.
    Returns out [B,T,K,G,H] in q's dtype."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    B, T, K, G, H = q.shape
    Tp = -(-T // 128) * 128
    real = layout.q_pos >= 0
    seg = real.astype(jnp.int32) if layout.q_seg is None else jnp.where(real, layout.q_seg, 0)
    seg = jnp.pad(seg, ((0, 0), (0, Tp - T)), constant_values=-1)  # padded slots: a segment of their own
    dt = q.dtype
    qh = jnp.transpose((q * jnp.asarray(scale, dt)), (0, 2, 3, 1, 4))  # [B,K,G,T,H]
    qh = jnp.pad(qh, ((0, 0),) * 3 + ((0, Tp - T), (0, 0)))
    kh = jnp.pad(k.astype(dt), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))
    vh = jnp.pad(v.astype(dt), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))
    kern = _kernel(Tp, G, cap, interpret, jnp.dtype(dt).itemsize <= 2 or LONG_F32)

    def row(qr, kr, vr, s):  # one row: [K,G,Tp,H], [K,Tp,H] x2, [Tp]
        ids = SegmentIds(q=s, kv=s)
        return jax.vmap(lambda a, b, c: kern(a, b, c, segment_ids=ids))(qr, kr, vr)

    out = jax.vmap(row)(qh, kh, vh, seg)[:, :, :, :T]  # [B,K,G,T,H]
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).astype(dt)
    return jnp.where(real[:, :, None, None, None], out, 0)

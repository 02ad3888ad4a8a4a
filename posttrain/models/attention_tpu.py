"""Attention on a TPU through JAX's Pallas splash-attention kernel (`jax.experimental.pallas.ops.tpu`).

Used by `attention.attention` for the training layouts it expresses: causal rows without a cache, with packed
segments, padding, grouped-query heads and tanh soft-capping. It is not used for prefix-shared rows (branches),
sliding windows (the kernel's window is by slot, posttrain's by position), attention sinks or a KV cache: those
stay on `attention.blockwise`. Splash keeps no [T, S] tensor (its backward recomputes tiles from the saved
log-sum-exp, as FlashAttention-2) and skips the tiles above the causal diagonal.

Numerics: the kernel scores in float32 from q pre-multiplied by the scale in q's dtype, so in bfloat16 it equals
`attention.dense` to bfloat16 round-off; `interpret=True` runs the same kernel on a CPU (tests/test_attention_tpu.py).
Queries with no key to attend (padding) output zeros, as `dense` does.

`decode` (below, opt-in through `attention.DECODE_KERNEL`): a Pallas kernel of this module's own for decode steps,
one query a row against a KV cache, reading it only up to the query's slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG = -1e30  # the running max's floor (attention.NEG)

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


# ------------------------------------------------------------------------------------------ decode (one query a row)

DECODE_BYTES = 4 << 20  # keys read per grid step (rows x cache rows x slots x lanes), about: fewer, larger steps
DECODE_SLOTS = 128  # slots per grid step: the step past the query's slot is skipped, so a cache is read to its fill


def decode_blocks(B: int, Kp: int, S: int, W: int, itemsize: int):
    """(rows, slots) a grid step of `decode` reads: slots DECODE_SLOTS (all S when shorter), rows the largest
    divisor of B whose keys stay within DECODE_BYTES."""
    bs = S if S <= DECODE_SLOTS else DECODE_SLOTS
    per_row = Kp * bs * W * itemsize
    rows = max(1, min(B, DECODE_BYTES // per_row))
    while B % rows:
        rows -= 1
    return rows, bs


def _decode_kernel(last_ref, q_ref, k_ref, v_ref, kpos_ref, qpos_ref, o_ref, m_sc, l_sc, acc_sc, *, bs: int,
                   S: int, scale: float, cap, window):
    j = pl.program_id(1)
    last = last_ref[0]

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j * bs <= last)
    def _():
        rows, Kp, PG, W = q_ref.shape
        n = rows * Kp
        q = q_ref[...].reshape(n, PG, W)
        k = k_ref[...].reshape(n, bs, W).astype(q.dtype)
        v = v_ref[...].reshape(n, bs, W).astype(q.dtype)
        # the products' precision stated (bfloat16: one pass; float32: exact), not the process's default: Mosaic
        # refuses bfloat16 operands at JAX_DEFAULT_MATMUL_PRECISION=highest ("Bad lhs type", seen on a v5e)
        prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
        s = jnp.einsum("nqd,nsd->nqs", q, k, preferred_element_type=jnp.float32, precision=prec) * scale
        if cap is not None:
            s = jnp.tanh(s / cap) * cap
        slot = j * bs + jax.lax.broadcasted_iota(jnp.int32, (1, 1, bs), 2)
        kpos = kpos_ref[...]  # [rows, 1, bs]
        ok = (kpos >= 0) & (slot <= last)
        if window is not None:
            ok = ok & (qpos_ref[...] - kpos < window)
        ok = jnp.broadcast_to(ok[:, None], (rows, Kp, 1, bs)).reshape(n, 1, bs)
        s = jnp.where(ok, s, NEG)
        m_prev = jnp.max(m_sc[...], axis=-1, keepdims=True)  # [n, PG, 1] (every lane holds it)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * jnp.max(l_sc[...], axis=-1, keepdims=True) + jnp.sum(p, axis=-1, keepdims=True)
        if S % bs:  # the last block runs past the cache: its slots beyond are not memory of it (any bits)
            inside = (j * bs + jax.lax.broadcasted_iota(jnp.int32, (1, bs, 1), 1)) < S
            v = jnp.where(inside, v, jnp.zeros((), v.dtype))
        pv = jnp.einsum("nqs,nsd->nqd", p.astype(q.dtype), v, preferred_element_type=jnp.float32, precision=prec)
        acc_sc[...] = alpha * acc_sc[...] + pv
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
        l_sc[...] = jnp.broadcast_to(l_new, l_sc.shape)

    @pl.when(j == jax.lax.div(last, bs))
    def _():
        total = jnp.max(l_sc[...], axis=-1, keepdims=True)
        out = jnp.where(total > 0, acc_sc[...] / jnp.where(total > 0, total, 1.0), 0.0)
        o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)


def decode(q, k, v, layout, *, scale: float, cap, window=None, interpret: bool = False, blocks=None):
    """One query a row (T = 1) against a KV cache k, v [B, K', S, W] (W = P*H: P heads a cache row,
    attention.pack_heads; any storage dtype the kernel casts, float8 included) with a cache `Layout` (the query's
    slot, layout.q_slot [1], the same for every row). A Pallas kernel: a grid step reads `blocks` = (rows, slots) of
    keys and values (decode_blocks), scores them in float32 and keeps an online softmax; steps past the query's slot
    read nothing, so a call reads the cache up to its fill, not its allocated slots. The P heads of a row are
    scored in one product as `attention.dense` does (each query head's vector in its own head's lanes).
    Returns out [B,1,K,G,H] in q's dtype (zeros for a query with no key)."""
    B, T, K, G, H = q.shape
    assert T == 1, "decode takes one query a row"
    _, Kp, S, W = k.shape
    P = W // H
    dt = q.dtype
    eye = jnp.eye(P, dtype=dt)
    qe = (q.reshape(B, Kp, P, G, 1, H) * eye[:, None, :, None]).reshape(B, Kp, P * G, W)
    R = -(-P * G // 8) * 8  # query rows a cache row, padded to whole 8-row sublane tiles (zero rows: no effect)
    qe = jnp.pad(qe, ((0, 0), (0, 0), (0, R - P * G), (0, 0)))
    rows, bs = blocks or decode_blocks(B, Kp, S, W, jnp.dtype(k.dtype).itemsize)
    last = layout.q_slot[:1].astype(jnp.int32)
    kpos = layout.k_pos.astype(jnp.int32)[:, None, :]  # [B, 1, S]
    qpos = layout.q_pos.astype(jnp.int32)[:, :, None]  # [B, 1, 1]

    def kv_block(i, j, last_ref):  # past the query's slot: the block already read (no new copy)
        return i, 0, jnp.minimum(j, jax.lax.div(last_ref[0], bs)), 0

    grid = (B // rows, pl.cdiv(S, bs))
    kernel = functools.partial(_decode_kernel, bs=bs, S=S, scale=float(scale), cap=cap, window=window)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid,
            in_specs=[pl.BlockSpec((rows, Kp, R, W), lambda i, j, _: (i, 0, 0, 0)),
                      pl.BlockSpec((rows, Kp, bs, W), kv_block),
                      pl.BlockSpec((rows, Kp, bs, W), kv_block),
                      pl.BlockSpec((rows, 1, bs), lambda i, j, r: (i, 0, jnp.minimum(j, jax.lax.div(r[0], bs)))),
                      pl.BlockSpec((rows, 1, 1), lambda i, j, _: (i, 0, 0))],
            out_specs=pl.BlockSpec((rows, Kp, R, W), lambda i, j, _: (i, 0, 0, 0)),
            scratch_shapes=[pltpu.VMEM((rows * Kp, R, 128), jnp.float32),
                            pltpu.VMEM((rows * Kp, R, 128), jnp.float32),
                            pltpu.VMEM((rows * Kp, R, W), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((B, Kp, R, W), dt),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=64 << 20),
        interpret=interpret,
    )(last, qe, k, v, kpos, qpos)
    # each query head keeps its own head's lanes
    out = jnp.einsum("bkpgqh,pq->bkpgh", out[:, :, :P * G].reshape(B, Kp, P, G, P, H), eye)
    return out.reshape(B, 1, K, G, H)

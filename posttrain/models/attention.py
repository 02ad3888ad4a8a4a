"""The one attention of the model: its masking rule, and the implementations chosen by backend and shape.

Masking rule (the only one; `Layout` carries its inputs): a query attends a key when
  - the key slot holds a real token (k_pos >= 0; padding and empty cache slots are -1),
  - the key's slot is not after the query's slot (causal by slot index),
  - both are in the same segment (packing; segment 0 is padding),
  - the key is in the shared prefix (branch 0) or in the query's own branch (prefix-shared rows:
    a prompt once, then k continuations as branches 1..k, each attending the prompt and itself),
  - on sliding-window layers, q_pos - k_pos < window (by position, query included),
  except that the two rules above (causal, window) give way inside an image block (image ids, `Layout.q_image`:
  0 = text, b > 0 = image b of the row): a query attends every key of its own image, before or after it, as
  transformers' Gemma 3 `token_type_ids` mask ((causal and window) or same image; then padding, segments, branches).
A query with no key to attend outputs zeros. Attention sinks (GPT-OSS, `sinks` [K, G]): a learned logit per
query head joins every row's softmax as one more key whose value is zero, so a row's probabilities sum to less
than 1.

Implementations, all giving the same outputs and gradients (tests/test_attention.py):
  - "dense": float32 scores, the [B, T, S] mask, softmax. The reference; used for decode steps
    (T = 1), short rows, and when attention probabilities are asked for.
  - "blockwise": online softmax over [block_q x block_k] tiles with a custom VJP that recomputes
    each tile's probabilities in the backward pass from the saved log-sum-exp (FlashAttention-2,
    arXiv 2307.08691), so no [T, S] tensor is kept. Tiles no query may attend (above the causal
    diagonal, between segments or branches, outside the window) are skipped: the causal triangle
    statically, the rest from per-tile summaries of positions, segments and branches, so the loop
    runs over active tiles only. Prefix-shared rows therefore cost no attention between branches.
  - "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` on NVIDIA GPUs for layouts it
    expresses (no branches, no soft-capping, no cache).
  - "decode": a Pallas kernel on a TPU for decode steps (one query a row against a cache, no branches or sinks):
    it reads the cache only up to the query's slot, in (rows x slots) blocks with an online softmax
    (models/attention_tpu.decode); opt-in (`DECODE_KERNEL`: slower than dense inside the sampler's step on a
    v5e); "decode_interpret" runs it interpreted on a CPU (tests).
  - "splash": JAX's Pallas splash-attention kernel on a TPU for causal rows without a cache, branches, window
    or sinks (models/attention_tpu.py); "splash_interpret" runs the same kernel interpreted on a CPU (tests).
`choose` picks one from the backend and the static layout facts; it is unit-tested on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

NEG = -1e30  # running-max floor: finite, so exp(NEG - NEG) never makes a NaN
TILE_WORK = 65536  # rows x tile^2: the tile is the largest of 64/128/256 within it (measured on 2 CPU cores:
#                   8 x 256 -> 64, 4 x 512 -> 128, 1 x 2048 -> 256 were each the fastest tile, 2-5x the dense path)
BLOCK = None  # a fixed tile size instead (tests set it)
DENSE_MAX = 64  # rows no longer than this use the dense path
# a TPU's decode steps (one query a row, a cache) through the Pallas decode kernel (True) or dense (False, the
# default): on a v5e chip the kernel beats the dense attention alone (llama3-1b's, 16 layers of 64 / 256 rows x 384
# filled slots of 640: 131 / 351 us a layer against 159 / 520) but not inside the sampler's decode step, where XLA
# fuses the dense one with its neighbours (64 rows: 5.14 ms a step against 4.77; docs/benchmarks.md, 14th session)
DECODE_KERNEL = False
TPU_TILE = 512  # blockwise tile on a TPU (prefix-shared rows, windows, caches: what splash does not take)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layout:
    """What the masking rule reads, per query [B, T] and per key [B, S] (int32).

    q_pos / k_pos: positions, -1 for padding (queries) and empty or padding slots (keys).
    q_slot [T] / k_slot [S]: slot indices (causal order), the same for every row.
    q_seg / k_seg: segment ids (packing) or None; q_branch / k_branch: branch ids or None.
    q_image / k_image: image block ids (0 = text; a vision-language model's images) or None.
    causal_aligned (static): queries are keys 0..T-1 (no cache): the causal triangle of tiles
    is known at trace time.
    """

    q_pos: jax.Array
    k_pos: jax.Array
    q_slot: jax.Array
    k_slot: jax.Array
    q_seg: Optional[jax.Array] = None
    k_seg: Optional[jax.Array] = None
    q_branch: Optional[jax.Array] = None
    k_branch: Optional[jax.Array] = None
    q_image: Optional[jax.Array] = None
    k_image: Optional[jax.Array] = None
    causal_aligned: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def mask(self, window: Optional[int]) -> jax.Array:
        """The [B, T, S] bool mask."""
        return _mask(self.q_pos, self.k_pos, self.q_slot, self.k_slot, self.q_seg, self.k_seg,
                     self.q_branch, self.k_branch, window, self.q_image, self.k_image)


def _mask(q_pos, k_pos, q_slot, k_slot, q_seg, k_seg, q_br, k_br, window, q_img=None, k_img=None):
    order = k_slot[None, None, :] <= q_slot[None, :, None]  # causal, and within the window
    if window is not None:
        order = order & ((q_pos[:, :, None] - k_pos[:, None, :]) < window)
    if q_img is not None:  # both ways inside one image
        order = order | ((q_img[:, :, None] == k_img[:, None, :]) & (q_img[:, :, None] != 0))
    m = (k_pos[:, None, :] >= 0) & order
    if q_seg is not None:
        m &= q_seg[:, :, None] == k_seg[:, None, :]
    if q_br is not None:
        m &= (k_br[:, None, :] == 0) | (k_br[:, None, :] == q_br[:, :, None])
    return m


def softcap(x, cap: Optional[float]):
    return x if cap is None else jnp.tanh(x / cap) * cap


# ------------------------------------------------------------------------------------------ entry point


def attention(q, k, v, layout: Layout, *, window: Optional[int], scale: float, cap: Optional[float],
              impl: str = "auto", return_probs: bool = False, sinks=None):
    """q [B,T,K,G,H]; k, v [B,K,S,H]; sinks [K,G] or None. Returns (out [B,T,K,G,H] in q's dtype,
    probs [B,K,G,T,S] or None)."""
    if impl == "auto":
        impl = choose(jax.default_backend(), T=q.shape[1], S=k.shape[2], branches=layout.q_branch is not None,
                      softcap=cap is not None or sinks is not None, cached=not layout.causal_aligned,
                      return_probs=return_probs, window=window is not None, sinks=sinks is not None,
                      images=layout.q_image is not None)
    if impl == "dense" or return_probs:  # dense reads a packed cache as it is
        return dense(q, k, v, layout.mask(window), scale=scale, cap=cap, return_probs=return_probs, sinks=sinks)
    if impl in ("decode", "decode_interpret"):  # one query a row against a cache: Pallas (models/attention_tpu.py)
        from posttrain.models.attention_tpu import decode

        return decode(q, k, v, layout, scale=scale, cap=cap, window=window, interpret=impl != "decode"), None
    if k.shape[-1] != q.shape[-1]:  # a packed cache (pack_heads): the tiled paths read heads apart
        k, v = unpack_heads(k, q.shape[-1]), unpack_heads(v, q.shape[-1])
    if impl == "cudnn":
        if sinks is not None:
            raise ValueError("the cudnn attention has no sinks; use dense or blockwise")
        return _cudnn(q, k, v, layout, window=window, scale=scale), None
    if impl in ("splash", "splash_interpret"):  # Pallas on a TPU (models/attention_tpu.py); interpreted on a CPU
        from posttrain.models.attention_tpu import splash

        return splash(q, k, v, layout, scale=scale, cap=cap, interpret=impl == "splash_interpret"), None
    if impl != "blockwise":
        raise ValueError(f"unknown attention implementation {impl!r}")
    return blockwise(q, k, v, layout, window=window, scale=scale, cap=cap, sinks=sinks), None


def kv_pack(head_dim: int, kv_heads: int, backend: Optional[str] = None) -> int:
    """Heads a KV cache row holds side by side: on a TPU, 128 // head_dim when heads are narrower than its 128
    lanes (and their count divides), else 1. A [B, K, S, 64] cache gets a layout with the slots in the lanes
    there (64-wide rows would be half padding), and writing one slot of it rewrites the whole cache: measured on
    a v5e chip (benchmarks/kv_layout.py), a 16-layer decode step of 64 rows x 640 slots took 7.75 ms with
    [B, K, S, 64] and 4.26 ms with two heads a row, [B, K/2, S, 128]; 256 rows: 25.7 ms against 8.8 ms."""
    backend = backend or jax.default_backend()
    if backend != "tpu" or not 0 < head_dim < 128 or 128 % head_dim or kv_heads % (128 // head_dim):
        return 1
    return 128 // head_dim


def pack_heads(x, p: int):
    """[B, K, S, H] -> [B, K/p, S, p*H]: heads k*p .. k*p + p - 1 side by side in row k."""
    if p == 1:
        return x
    B, K, S, H = x.shape
    return x.reshape(B, K // p, p, S, H).transpose(0, 1, 3, 2, 4).reshape(B, K // p, S, p * H)


def unpack_heads(x, head_dim: int):
    """The inverse of pack_heads: [B, K/p, S, p*H] -> [B, K, S, H]."""
    B, Kp, S, W = x.shape
    p = W // head_dim
    return x.reshape(B, Kp, S, p, head_dim).transpose(0, 1, 3, 2, 4).reshape(B, Kp * p, S, head_dim)


def choose(backend: str, *, T: int, S: int, branches: bool, softcap: bool, cached: bool,
           return_probs: bool = False, window: bool = False, sinks: bool = False, images: bool = False) -> str:
    """The implementation for these static facts (see the module docstring). `softcap` is true with sinks too;
    `images`: image blocks (bidirectional inside each), which only dense and blockwise express."""
    if backend == "tpu" and T == 1 and cached and DECODE_KERNEL and not (return_probs or branches or sinks or images):
        return "decode"
    if return_probs or T == 1 or max(T, S) <= DENSE_MAX:
        return "dense"
    if backend == "gpu" and not (branches or softcap or cached or images):
        return "cudnn"
    if backend == "tpu" and not (branches or cached or window or sinks or images):
        return "splash"
    return "blockwise"


# ------------------------------------------------------------------------------------------ dense


def dense(q, k, v, mask, *, scale, cap, return_probs=False, sinks=None):
    """The reference: float32 scores, masked softmax (with the sink logits, if any, as one more key of value
    zero); rows with nothing to attend output 0."""
    dt = q.dtype
    P = k.shape[-1] // q.shape[-1]  # heads packed side by side in a cache row (pack_heads), 1 for none
    if P > 1:  # each head's query in its own lanes, zeros elsewhere: one product per packed row, exact
        B, T, K, G, H = q.shape
        eye = jnp.eye(P, dtype=dt)
        q = (q.reshape(B, T, K // P, P, G, 1, H) * eye[:, None, :, None]).reshape(B, T, K // P, P * G, P * H)
    s = jnp.einsum("btkgh,bksh->bkgts", q, k.astype(dt)).astype(jnp.float32) * scale
    if P > 1:
        s = s.reshape(B, K, G, T, s.shape[-1])
    s = softcap(s, cap)
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1).astype(dt)
    else:
        sk = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None, None], s.shape[:-1] + (1,))
        p = jax.nn.softmax(jnp.concatenate([s, sk], axis=-1), axis=-1)[..., :-1].astype(dt)
    if P > 1:  # every packed head's values, then each query head keeps its own head's lanes
        o = jnp.einsum("bkgts,bksh->btkgh", p.reshape(B, K // P, P * G, T, -1), v.astype(dt))
        out = (o.reshape(B, T, K // P, P, G, P, H) * eye[:, None, :, None]).sum(axis=5).reshape(B, T, K, G, H)
    else:
        out = jnp.einsum("bkgts,bksh->btkgh", p, v.astype(dt))
    out = jnp.where(jnp.any(mask, -1)[:, :, None, None, None], out, 0)
    return out, (p if return_probs else None)


# ------------------------------------------------------------------------------------------ blockwise


def _pad(x, axis, n, value=0):
    extra = n - x.shape[axis]
    if extra == 0:
        return x
    fill = jnp.full(x.shape[:axis] + (extra,) + x.shape[axis + 1:], value, x.dtype)
    return jnp.concatenate([x, fill], axis=axis)


def blockwise(q, k, v, layout: Layout, *, window, scale, cap, block_q: Optional[int] = None,
              block_k: Optional[int] = None, sinks=None):
    """Tiled attention with skipped tiles and a recomputing backward pass; equals `dense`."""
    B, T = q.shape[:2]
    S = k.shape[2]
    if BLOCK:
        tile = BLOCK
    elif jax.default_backend() == "tpu":  # the loop's per-tile cost dominates small tiles there: few, large ones
        tile = TPU_TILE
    else:
        tile = max([64] + [t for t in (64, 128, 256) if B * t * t <= TILE_WORK])
    bq, bk = min(block_q or tile, T), min(block_k or tile, S)
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    lay = _padded_layout(layout, Tp, Sp)
    q, k, v = _pad(q, 1, Tp), _pad(k, 2, Sp), _pad(v, 2, Sp)
    nq, nk = Tp // bq, Sp // bk
    if layout.causal_aligned and layout.q_image is None:  # tiles wholly above the diagonal are never attended
        pairs = [(i, j) for i in range(nq) for j in range(nk) if j * bk <= (i + 1) * bq - 1]
    else:
        pairs = [(i, j) for i in range(nq) for j in range(nk)]
    pi, pj = np.array(pairs, np.int32).T
    active = _active_tiles(lay, window, bq, bk)[pi, pj]  # [P]
    count = jnp.sum(active, dtype=jnp.int32)
    order = jnp.nonzero(active, size=len(pairs), fill_value=0)[0]
    tiles = (jnp.asarray(pi)[order], jnp.asarray(pj)[order], count)
    out = _flash(q, k, v, sinks, lay, tiles, (window, scale, cap, bq, bk))
    return out[:, :T]


def _padded_layout(lay: Layout, Tp: int, Sp: int) -> Layout:
    T, S = lay.q_pos.shape[1], lay.k_pos.shape[1]

    def slots(x, n):
        return jnp.concatenate([x, x[-1] + 1 + jnp.arange(n - x.shape[0], dtype=x.dtype)]) if n > x.shape[0] else x

    return Layout(
        q_pos=_pad(lay.q_pos, 1, Tp, -1), k_pos=_pad(lay.k_pos, 1, Sp, -1),
        q_slot=slots(lay.q_slot, Tp), k_slot=slots(lay.k_slot, Sp),
        q_seg=None if lay.q_seg is None else _pad(lay.q_seg, 1, Tp),
        k_seg=None if lay.k_seg is None else _pad(lay.k_seg, 1, Sp),
        q_branch=None if lay.q_branch is None else _pad(lay.q_branch, 1, Tp),
        k_branch=None if lay.k_branch is None else _pad(lay.k_branch, 1, Sp),
        q_image=None if lay.q_image is None else _pad(lay.q_image, 1, Tp),
        k_image=None if lay.k_image is None else _pad(lay.k_image, 1, Sp),
        causal_aligned=lay.causal_aligned and T == S and Tp == Sp)


def _active_tiles(lay: Layout, window, bq: int, bk: int) -> jax.Array:
    """[nq, nk] bool: may any query of tile i attend any key of tile j in some row? (conservative)

    From per-tile summaries: slot range (causal), real keys, segment and branch ranges (packed
    segments and branches increase along a row), the smallest query minus the largest key
    position (window), and image-id ranges (a shared image lifts the causal and window tests)."""
    B, Tp = lay.q_pos.shape
    big = jnp.int32(2 ** 30)

    def tiles(x, b):
        return x.reshape(x.shape[0], -1, b)

    q_real, k_real = tiles(lay.q_pos >= 0, bq), tiles(lay.k_pos >= 0, bk)

    def rng(x, real, b):  # per-tile (min, max) over real tokens
        x = tiles(x, b)
        return jnp.where(real, x, big).min(-1), jnp.where(real, x, -big).max(-1)

    q_slot_max = lay.q_slot.reshape(-1, bq).max(-1)
    k_slot_min = lay.k_slot.reshape(-1, bk).min(-1)
    order = jnp.broadcast_to(k_slot_min[None, None, :] <= q_slot_max[None, :, None],
                             (B, q_slot_max.shape[0], k_slot_min.shape[0]))
    if window is not None:
        qlo, _ = rng(lay.q_pos, q_real, bq)
        _, khi = rng(lay.k_pos, k_real, bk)
        order &= (qlo[:, :, None] - khi[:, None, :]) < window
    if lay.q_image is not None:
        qlo, qhi = rng(lay.q_image, q_real & tiles(lay.q_image != 0, bq), bq)
        klo, khi = rng(lay.k_image, k_real & tiles(lay.k_image != 0, bk), bk)
        order |= (qlo[:, :, None] <= khi[:, None, :]) & (klo[:, None, :] <= qhi[:, :, None])
    act = order & k_real.any(-1)[:, None, :]
    act &= q_real.any(-1)[:, :, None]
    if lay.q_seg is not None:
        qlo, qhi = rng(lay.q_seg, q_real, bq)
        klo, khi = rng(lay.k_seg, k_real, bk)
        act &= (qlo[:, :, None] <= khi[:, None, :]) & (klo[:, None, :] <= qhi[:, :, None])
    if lay.q_branch is not None:
        kb = tiles(lay.k_branch, bk)
        has_prefix = (k_real & (kb == 0)).any(-1)
        qlo, qhi = rng(lay.q_branch, q_real, bq)
        klo, khi = rng(lay.k_branch, k_real & (kb != 0), bk)
        act &= has_prefix[:, None, :] | ((qlo[:, :, None] <= khi[:, None, :]) & (klo[:, None, :] <= qhi[:, :, None]))
    return act.any(0)


def _tile_mask(lay: Layout, window, i, j, bq, bk):
    def qs(x):
        return jax.lax.dynamic_slice_in_dim(x, i * bq, bq, axis=x.ndim - 1)

    def ks(x):
        return jax.lax.dynamic_slice_in_dim(x, j * bk, bk, axis=x.ndim - 1)

    opt = lambda f, x: None if x is None else f(x)  # noqa: E731
    return _mask(qs(lay.q_pos), ks(lay.k_pos), qs(lay.q_slot), ks(lay.k_slot), opt(qs, lay.q_seg),
                 opt(ks, lay.k_seg), opt(qs, lay.q_branch), opt(ks, lay.k_branch), window, opt(qs, lay.q_image),
                 opt(ks, lay.k_image))


def _tile_scores(a, b, m, scale, cap, spec="bkgth,bksh->bkgts"):
    """float32 scores of a tile (soft-capped), -inf where `m` is False, and tanh for the VJP.

    The forward reads [B,K,G,bq,bk] (`spec` over q, k); the backward the transposed [B,K,G,bk,bq] (k, q)."""
    s = jnp.einsum(spec, a, b).astype(jnp.float32) * scale
    t = None
    if cap is not None:
        t = jnp.tanh(s / cap)
        s = t * cap
    return jnp.where(m[:, None, None], s, -jnp.inf), t


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, sinks, lay, tiles, static):
    return _flash_fwd(q, k, v, sinks, lay, tiles, static)[0]


def _flash_fwd(q, k, v, sinks, lay, tiles, static):
    window, scale, cap, bq, bk = static
    B, Tp, K, G, H = q.shape
    dt = q.dtype
    k, v = k.astype(dt), v.astype(dt)
    qt = jnp.transpose(q, (0, 2, 3, 1, 4))  # [B,K,G,Tp,H]: tiles are slices of one axis, no per-tile transpose
    ti, tj, count = tiles
    f32 = jnp.float32

    def body(c, carry):
        m, den, acc = carry
        i, j = ti[c], tj[c]
        qb = jax.lax.dynamic_slice_in_dim(qt, i * bq, bq, axis=3)
        kb = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
        vb = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
        s, _ = _tile_scores(qb, kb, _tile_mask(lay, window, i, j, bq, bk), scale, cap)
        m_old = jax.lax.dynamic_slice_in_dim(m, i * bq, bq, axis=3)
        l_old = jax.lax.dynamic_slice_in_dim(den, i * bq, bq, axis=3)
        a_old = jax.lax.dynamic_slice_in_dim(acc, i * bq, bq, axis=3)
        m_new = jnp.maximum(m_old, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m_old - m_new)
        l_new = l_old * corr + p.sum(-1)
        a_new = a_old * corr[..., None] + jnp.einsum("bkgts,bksh->bkgth", p.astype(dt), vb).astype(f32)
        m = jax.lax.dynamic_update_slice_in_dim(m, m_new, i * bq, axis=3)
        den = jax.lax.dynamic_update_slice_in_dim(den, l_new, i * bq, axis=3)
        acc = jax.lax.dynamic_update_slice_in_dim(acc, a_new, i * bq, axis=3)
        return m, den, acc

    if sinks is None:
        m0, den0 = jnp.full((B, K, G, Tp), NEG, f32), jnp.zeros((B, K, G, Tp), f32)
    else:  # the sink starts the online softmax: running max = its logit, exp(sink - max) = 1 in the denominator
        m0, den0 = jnp.broadcast_to(sinks.astype(f32)[None, :, :, None], (B, K, G, Tp)), jnp.ones((B, K, G, Tp), f32)
    init = (m0, den0, jnp.zeros((B, K, G, Tp, H), f32))
    m, den, acc = jax.lax.fori_loop(0, count, body, init)
    safe = jnp.where(den > 0, den, 1.0)
    out = jnp.where((den > 0)[..., None], acc / safe[..., None], 0.0)
    lse = m + jnp.log(safe)
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).astype(dt)  # [B,Tp,K,G,H]
    return out, (qt, k, v, sinks, lay, tiles, out, lse)


def _flash_bwd(static, res, dout):
    window, scale, cap, bq, bk = static
    qt, k, v, sinks, lay, tiles, out, lse = res  # qt [B,K,G,Tp,H]
    dt = qt.dtype
    f32 = jnp.float32
    ti, tj, count = tiles
    # D = rowsum(dO * O): the softmax Jacobian's diagonal term, one per query and head
    d = jnp.transpose(jnp.sum(dout.astype(f32) * out.astype(f32), -1), (0, 2, 3, 1))  # [B,K,G,Tp]
    dout = jnp.transpose(dout.astype(dt), (0, 2, 3, 1, 4))

    def body(c, carry):
        dq, dk, dv = carry
        i, j = ti[c], tj[c]
        qb = jax.lax.dynamic_slice_in_dim(qt, i * bq, bq, axis=3)
        dob = jax.lax.dynamic_slice_in_dim(dout, i * bq, bq, axis=3)
        kb = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
        vb = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
        # transposed tile [.., s, t]: dV = P^T dO and dK = dS^T Q are then plain matmuls (no per-tile transpose)
        m = jnp.swapaxes(_tile_mask(lay, window, i, j, bq, bk), 1, 2)  # [B,bk,bq]
        s, t = _tile_scores(kb, qb, m, scale, cap, "bksh,bkgth->bkgst")
        p = jnp.exp(s - jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)[..., None, :])  # 0 where masked
        dp = jnp.einsum("bksh,bkgth->bkgst", vb, dob).astype(f32)
        ds = p * (dp - jax.lax.dynamic_slice_in_dim(d, i * bq, bq, axis=3)[..., None, :])
        if t is not None:
            ds = ds * (1.0 - t * t)
        ds = (ds * scale).astype(dt)
        dv_j = jnp.einsum("bkgst,bkgth->bksh", p.astype(dt), dob).astype(f32)
        dk_j = jnp.einsum("bkgst,bkgth->bksh", ds, qb).astype(f32)
        dq_i = jnp.einsum("bkgst,bksh->bkgth", ds, kb).astype(f32)
        dq = jax.lax.dynamic_update_slice_in_dim(
            dq, jax.lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=3) + dq_i, i * bq, axis=3)
        dk = jax.lax.dynamic_update_slice_in_dim(
            dk, jax.lax.dynamic_slice_in_dim(dk, j * bk, bk, axis=2) + dk_j, j * bk, axis=2)
        dv = jax.lax.dynamic_update_slice_in_dim(
            dv, jax.lax.dynamic_slice_in_dim(dv, j * bk, bk, axis=2) + dv_j, j * bk, axis=2)
        return dq, dk, dv

    init = (jnp.zeros(qt.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32))
    dq, dk, dv = jax.lax.fori_loop(0, count, body, init)
    dq = jnp.transpose(dq, (0, 3, 1, 2, 4))  # back to [B,Tp,K,G,H]
    dsinks = None
    if sinks is not None:  # the sink's probability times (its zero value's dP - D): -sum over rows of p_sink * D
        p_sink = jnp.exp(sinks.astype(f32)[None, :, :, None] - lse)
        dsinks = (-jnp.sum(p_sink * d, axis=(0, 3))).astype(sinks.dtype)
    return dq.astype(dt), dk.astype(k.dtype), dv.astype(v.dtype), dsinks, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------------------ GPU


def _cudnn(q, k, v, layout: Layout, *, window, scale):
    """cuDNN flash attention through jax.nn for causal (+ segments as a mask, + window) layouts."""
    B, T, K, G, H = q.shape
    qh = q.reshape(B, T, K * G, H)
    kt, vt = jnp.swapaxes(k, 1, 2).astype(q.dtype), jnp.swapaxes(v, 1, 2).astype(q.dtype)  # [B,S,K,H]
    mask = None
    if layout.q_seg is not None:
        mask = (layout.q_seg[:, :, None] == layout.k_seg[:, None, :]) & (layout.k_pos[:, None, :] >= 0)
        mask = mask[:, None]
    out = jax.nn.dot_product_attention(qh, kt, vt, mask=mask, scale=scale, is_causal=True,
                                       local_window_size=None if window is None else (window - 1, 0),
                                       implementation="cudnn")
    return out.reshape(B, T, K, G, H)

"""The gated delta rule (Gated DeltaNet, Yang et al. 2024, arXiv 2412.06464), the recurrence of Qwen3.5 /
Qwen3-Next linear-attention layers, in two exact forms.

Per head, with a state S [Dk, Dv] (zero, or carried in), for each token t:
  S <- exp(g_t) S                                   (gated decay; g_t <= 0 is a log decay)
  S <- S + k_t (beta_t (v_t - S^T k_t))^T           (the delta rule: write the error of S's prediction)
  o_t = S^T q_t
with q and k L2-normalised (eps 1e-6) and q scaled by Dk^-1/2, as transformers' `torch_recurrent_gated_delta_rule`
/ `torch_chunk_gated_delta_rule` (use_qk_l2norm_in_kernel=True) and the FLA kernels they stand for.

- `recurrent(...)`: token by token (a scan; one token without it): the decode step and the reference.
- `chunked(...)`: the WY / UT form over chunks of C tokens (training and prefill): inside a chunk the C updates
  are one triangular solve, (I + L)^-1 with L = strictly-lower(diag(beta) K K^T * decay), and matrix products;
  between chunks one state update. The scan over chunks rematerialises each chunk in the backward pass, so
  training memory is linear in length (tests/test_deltanet.py: temporaries 2048 -> 8192 tokens).
Both take q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta [B, T, H] (float32 inside) and an optional state
[B, H, Dk, Dv]; both return (o [B, T, H, Dv] in v's dtype, final state float32). Tokens with g = 0 and
beta = 0 leave the state unchanged (padding).

- `GatedDeltaNet`: the whole layer (projections, the causal depthwise convolution, the gated output norm),
  equal to transformers' `Qwen3_5GatedDeltaNet`, with its state (`LinearState`) carried between calls.

The Transformer runs it as the token mixer of its "linear" layers (Qwen3.5, models/qwen3_5.py), packed segments
(each from a zero state) and prefix-shared rows (each branch from the prompt's state and convolution inputs)
included.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

CHUNK = 64  # the most tokens per chunk of the layer's chunked form (FLA's and transformers' chunk size)


def chunk_for(T: int) -> int:
    """The layer's chunk for T tokens: CHUNK, or a smaller power of two (from 16) for short sequences, whose
    padding to a whole 64-token chunk cost up to 3x in the train step (16 tokens x 64 rows: 0.12 -> 0.03 s)."""
    c = min(16, CHUNK)
    while c < CHUNK and 2 * c < T:
        c *= 2
    return c


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(sum x^2 + eps) over the last axis (FLA's and transformers' l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def unit_lower_inverse(low):
    """(I + low)^-1 for a strictly lower-triangular `low` [..., C, C], C a power of two, by matrix products only:
    the inverses of the diagonal blocks double in size each round, [[A, 0], [X, B]]^-1 = [[A^-1, 0],
    [-B^-1 X A^-1, B^-1]]. (No LAPACK triangular solve: on CPU XLA calls scipy's OpenBLAS for it, whose thread
    server deadlocked when two layers' solves ran at once.)"""
    *lead, C, _ = low.shape
    if C & (C - 1):
        raise ValueError(f"unit_lower_inverse: the chunk {C} must be a power of two")
    inv = jnp.ones((*lead, C, 1, 1), low.dtype)  # the 1 x 1 diagonal blocks of the unit diagonal
    b = 1
    while b < C:
        n = C // (2 * b)
        pairs = inv.reshape(*lead, n, 2, b, b)
        a_inv, b_inv = pairs[..., 0, :, :], pairs[..., 1, :, :]
        diag = jnp.moveaxis(jnp.diagonal(low.reshape(*lead, n, 2 * b, n, 2 * b), axis1=-4, axis2=-2), -1, -3)
        x = diag[..., b:, :b]  # [..., n, b, b]: the rows of the second block, the columns of the first
        top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
        bottom = jnp.concatenate([-(b_inv @ x @ a_inv), b_inv], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)
        b *= 2
    return inv.reshape(*lead, C, C)


def _prepare(q, k, v, g, beta, normalize: bool):
    f32 = jnp.promote_types(v.dtype, jnp.float32)  # float32, or float64 under x64 (the tests' reference)
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    if normalize:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _step(s, x, branch: bool = False):
    """One token of the rule for every row and head (q, k, v [B, H, D], g, beta [B, H]): with d = exp(g), S^T k
    and S^T q in one product (S read twice, not three times), err = beta (v - d S^T k), S' = d S + k err^T and
    o = S'^T q = d S^T q + (k . q) err. branch (the decode step on a CPU): the [B, H, Dk, Dv] update runs in a
    `lax.cond` branch of its own, skipped when no row writes or decays (every row padding, where it is the
    identity); inlined, XLA on a CPU fused the producers of k and err (the convolution, norms, padding masks)
    into it and recomputed them for every element of S: the layer's decode step 289 -> 128 us."""
    qt, kt, vt, gt, bt = x
    d = jnp.exp(gt)[..., None]  # [B, H, 1]
    both = jnp.einsum("bhkv,bhnk->bhnv", s, jnp.stack([kt, qt], axis=2))
    sk, sq = both[:, :, 0], both[:, :, 1]
    err = (vt - d * sk) * bt[..., None]
    o = d * sq + jnp.sum(kt * qt, axis=-1, keepdims=True) * err

    def update(s, k, e, d):
        return s * d[..., None] + k[..., :, None] * e[..., None, :]

    if branch:
        return jax.lax.cond(jnp.any(bt != 0) | jnp.any(gt != 0), update, lambda s, *_: s, s, kt, err, d), o
    return update(s, kt, err, d), o


def recurrent(q, k, v, g, beta, state: Optional[jax.Array] = None, *, normalize: bool = True):
    """The gated delta rule token by token (see the module docstring); one token (the decode step) without a
    scan."""
    dt = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, normalize)
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    s0 = jnp.zeros((B, H, Dk, Dv), v.dtype) if state is None else state.astype(v.dtype)
    if T == 1:  # the decode step
        s, o = _step(s0, tuple(x[:, 0] for x in (q, k, v, g, beta)), branch=jax.default_backend() == "cpu")
        return o[:, None].astype(dt), s
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    s, o = jax.lax.scan(_step, s0, xs)
    return jnp.moveaxis(o, 0, 1).astype(dt), s


def chunked(q, k, v, g, beta, state: Optional[jax.Array] = None, *, chunk: int = 64, normalize: bool = True,
            resets=None, restart: Optional[jax.Array] = None):
    """The gated delta rule in chunks of `chunk` tokens (see the module docstring). resets [B, T] bool or None:
    tokens that start a new sequence (packed segments, the branches of a prefix-shared row): the state before
    them is replaced by `restart` [B, H, Dk, Dv] (a row's prompt state), or dropped (zero) when it is None."""
    dt = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, normalize)
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk
    pad = -T % C
    r = jnp.zeros((B, T, H), jnp.int32) if resets is None else jnp.broadcast_to(
        resets.astype(jnp.int32)[..., None], (B, T, H))
    if pad:  # padded tokens: g = 0, beta = 0, k = 0: the state passes through unchanged
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta, r = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta, r))
    n = (T + pad) // C

    def split(x):  # [B, T, H, ...] -> [n, B, H, C, ...]
        x = x.reshape((B, n, C, H) + x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

    qc, kc, vc, gc, bc, rc = (split(x) for x in (q, k, v, g, beta, r))
    s0 = jnp.zeros((B, H, Dk, Dv), v.dtype) if state is None else state.astype(v.dtype)
    s1 = None if restart is None else restart.astype(v.dtype)
    lower = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)

    @jax.checkpoint
    def body(s, x):
        qi, ki, vi, gi, bi, ri = x  # [B, H, C, ...]
        gi = jnp.cumsum(gi, axis=-1)  # log decay from the chunk start, inclusive
        # packed segments: token j reaches token i only within one segment; the carried state reaches the
        # tokens before the chunk's first reset (`fresh`); the next state holds the chunk's last segment only
        seg = jnp.cumsum(ri, axis=-1)  # [B, H, C] segment number inside the chunk
        same = seg[..., :, None] == seg[..., None, :]
        fresh = (seg == 0).astype(s.dtype)[..., None]
        tail = (seg == seg[..., -1:]).astype(s.dtype)[..., None]
        keep = (seg[..., -1] == 0).astype(s.dtype)
        decay = jnp.where(lower & same, jnp.exp(jnp.where(lower, gi[..., :, None] - gi[..., None, :], 0.0)), 0.0)
        kb = ki * bi[..., None]
        low = jnp.where(strict, jnp.einsum("bhik,bhjk->bhij", kb, ki) * decay, 0.0)
        if s1 is None:  # before a reset the state is zero: only the chunk's first segment reads s
            # (I + L)^-1 applied to [beta v | beta k exp(g)]: the chunk's C delta-rule updates at once
            rhs = jnp.concatenate([vi * bi[..., None], kb * jnp.exp(gi)[..., None] * fresh], axis=-1)
            solved = unit_lower_inverse(low) @ rhs
            u, w = solved[..., :Dv], solved[..., Dv:]
            v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, s)
            attn = jnp.where(lower, jnp.einsum("bhik,bhjk->bhij", qi, ki) * decay, 0.0)
            out = jnp.einsum("bhck,bhkv->bhcv", qi * jnp.exp(gi)[..., None] * fresh, s) + attn @ v_new
            last = gi[..., -1]
            s = s * (jnp.exp(last) * keep)[..., None, None] + jnp.einsum(
                "bhck,bhcv->bhkv", ki * jnp.exp(last[..., None] - gi)[..., None] * tail, v_new)
            return s, out
        # later segments start from s1, decayed from their own start: gl = the log decay since it
        at = jax.lax.cummax(jnp.where(ri > 0, jnp.arange(C), 0), axis=ri.ndim - 1)  # each token's segment start
        before = jnp.concatenate([jnp.zeros_like(gi[..., :1]), gi[..., :-1]], axis=-1)
        gl = gi - jnp.where(seg > 0, jnp.take_along_axis(before, at, axis=-1), 0.0)
        rhs = jnp.concatenate([vi * bi[..., None], kb * jnp.exp(gl)[..., None]], axis=-1)
        solved = unit_lower_inverse(low) @ rhs
        u, w = solved[..., :Dv], solved[..., Dv:]
        v_new = u - fresh * jnp.einsum("bhck,bhkv->bhcv", w, s) - (1 - fresh) * jnp.einsum("bhck,bhkv->bhcv", w, s1)
        attn = jnp.where(lower, jnp.einsum("bhik,bhjk->bhij", qi, ki) * decay, 0.0)
        qd = qi * jnp.exp(gl)[..., None]
        out = (fresh * jnp.einsum("bhck,bhkv->bhcv", qd, s) + (1 - fresh) * jnp.einsum("bhck,bhkv->bhcv", qd, s1)
               + attn @ v_new)
        last, tail_gl = gi[..., -1], gl[..., -1]
        start = s * (jnp.exp(last) * keep)[..., None, None] + s1 * (jnp.exp(tail_gl) * (1 - keep))[..., None, None]
        s = start + jnp.einsum("bhck,bhcv->bhkv", ki * jnp.exp(last[..., None] - gi)[..., None] * tail, v_new)
        return s, out

    s, o = jax.lax.scan(body, s0, (qc, kc, vc, gc, bc, rc))  # o [n, B, H, C, Dv]
    o = jnp.moveaxis(o, 0, 1).swapaxes(2, 3).reshape(B, n * C, H, Dv)[:, :T]
    return o.astype(dt), s


def valid_conv(x, weight, past, valid):
    """`causal_conv` over the valid tokens only (valid [B, T] bool): a tap reads the previous valid input (or the
    past), so padding anywhere in x (a left-padded block appended to a cache, a stopped row's feed) neither
    enters nor shifts the window. Returns (y [B, T, C]; at padding, whatever), the last K - 1 valid inputs)."""
    B, T, _ = x.shape
    K = weight.shape[1]
    full = jnp.concatenate([past.astype(x.dtype), x], axis=1)  # [B, K - 1 + T, C]
    if T == 1:  # the decode step: the window as it is; it moves only for a valid token
        y = jnp.sum(full * weight.T.astype(x.dtype)[None], axis=1, keepdims=True)  # a reduction: computed once
        return y, jnp.where(valid[:, :, None], full[:, 1:], past.astype(x.dtype))
    ok = jnp.concatenate([jnp.ones((B, K - 1), bool), valid], axis=1)
    at = jnp.cumsum(ok, axis=1, dtype=jnp.int32) - 1  # index among the valid inputs
    n = full.shape[1]
    rows = jnp.arange(B)[:, None]
    packed = jnp.zeros_like(full).at[rows, jnp.where(ok, at, n)].set(full, mode="drop")  # valid inputs first
    me = at[:, K - 1:]
    y = sum(jnp.take_along_axis(packed, jnp.maximum(me - (K - 1 - j), 0)[..., None], axis=1)
            * weight[:, j].astype(x.dtype) for j in range(K))
    count = at[:, -1:] + 1
    tail = jnp.take_along_axis(packed, (count - (K - 1) + jnp.arange(K - 1)[None])[..., None], axis=1)
    return y, tail


def branch_conv(x, weight, branches):
    """`causal_conv` of a prefix-shared row [prompt | c1 | ... | ck] (branch ids [B, T]: 0 on the prompt, i on
    continuation i): a branch's first taps read the end of the prompt, never a sibling, as in the unshared row
    [prompt | ci]. x [B, T, C], weight [C, K] -> y [B, T, C]."""
    B, T, _ = x.shape
    K = weight.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)[None]
    starts = jnp.concatenate([jnp.ones((B, 1), bool), branches[:, 1:] != branches[:, :-1]], axis=1)
    at = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)  # where each token's branch (or the prompt) starts
    prompt = jnp.argmax(branches > 0, axis=1).astype(jnp.int32)[:, None]  # the first branch's start
    y = jnp.zeros_like(x)
    for j in range(K):
        src = t - (K - 1 - j)
        src = jnp.where((branches > 0) & (src < at), prompt + src - at, src)  # before the branch: the prompt
        xs = jnp.take_along_axis(x, jnp.maximum(src, 0)[..., None], axis=1)
        y = y + xs * (src >= 0)[..., None].astype(x.dtype) * weight[:, j].astype(x.dtype)
    return y


class LinearState(NamedTuple):
    """What a Gated DeltaNet layer carries between calls (its cache): the last `kernel - 1` inputs of the
    causal convolution [B, kernel - 1, C] and the delta-rule state [B, Hv, Dk, Dv] (float32)."""
    conv: jax.Array
    recurrent: jax.Array


def causal_conv(x, weight, past, segments=None):
    """Depthwise causal convolution over time: x [B, T, C], weight [C, K] (HF `conv1d.weight[:, 0]`),
    past [B, K - 1, C] (the inputs before x; zeros at a sequence start). y_t = sum_j w_j x_{t - K + 1 + j}.
    segments [B, T] int or None: packed sequences; a tap reads only inputs of the token's own segment (past
    inputs belong to none). Returns (y [B, T, C], the last K - 1 inputs)."""
    K = weight.shape[1]
    full = jnp.concatenate([past.astype(x.dtype), x], axis=1)  # [B, K - 1 + T, C]
    T = x.shape[1]
    if segments is None:
        y = sum(full[:, j:j + T] * weight[:, j].astype(x.dtype) for j in range(K))
    else:
        seg = jnp.concatenate([jnp.full((x.shape[0], K - 1), -1, segments.dtype), segments], axis=1)
        y = sum(full[:, j:j + T] * weight[:, j].astype(x.dtype)
                * (seg[:, j:j + T] == segments)[..., None].astype(x.dtype) for j in range(K))
    return y, full[:, full.shape[1] - (K - 1):]


class GatedDeltaNet(nnx.Module):
    """The linear-attention layer of Qwen3.5 / Qwen3-Next (transformers' `Qwen3_5GatedDeltaNet`): projections
    to q, k, v (Hk key heads of Dk, Hv value heads of Dv; q and k repeated to Hv heads), a causal depthwise
    convolution (kernel K) with SiLU over the q, k, v channels, the gated delta rule with beta = sigmoid(b) and log
    decay g = -exp(A_log) softplus(a + dt_bias), an RMS norm of each head's output (weight w, not 1 + w)
    gated by SiLU(z), and the output projection.

    Parameter names follow HF's (`in_proj_qkv` [D, 2 Hk Dk + Hv Dv], `in_proj_z`, `in_proj_b`, `in_proj_a`,
    `conv` [C, K] = HF `conv1d.weight[:, 0]`, `dt_bias`, `A_log`, `norm`, `out_proj`), stored [in, out].
    One difference: the channels of `in_proj_qkv` and `conv` are grouped by key head, [q_g | k_g | v of the
    r = Hv / Hk value heads that read key head g] for each g (`grouped_channels` gives HF's [all q | all k | all v]
    order), so that under tensor parallelism each device holds whole key-head groups and computes its heads'
    delta rule without gathering q, k or v."""

    def __init__(self, embed_dim: int, *, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                 kernel: int = 4, eps: float = 1e-6, param_dtype=jnp.float32, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        from posttrain.sharding import param

        if value_heads % key_heads:
            raise ValueError(f"GatedDeltaNet: value_heads {value_heads} must be a multiple of key_heads {key_heads}")
        D, pd = embed_dim, jnp.dtype(param_dtype)
        init = nnx.initializers.normal(0.02)
        self.Hk, self.Hv, self.Dk, self.Dv, self.K = key_heads, value_heads, key_dim, value_dim, kernel
        self.channels = 2 * key_heads * key_dim + value_heads * value_dim
        # every projection split over the model axis by heads (tp: each device a block of whole key-head groups
        # and their value heads when the axis divides the key heads; when it divides only the channel count the
        # split falls inside a group: still exact, with collectives to move q, k, v)
        self.in_proj_qkv = param(init(rngs.params(), (D, self.channels), pd), ("embed", "heads"))
        self.in_proj_z = param(init(rngs.params(), (D, value_heads * value_dim), pd), ("embed", "heads"))
        self.in_proj_b = param(init(rngs.params(), (D, value_heads), pd), ("embed", "heads"))
        self.in_proj_a = param(init(rngs.params(), (D, value_heads), pd), ("embed", "heads"))
        self.conv = param(init(rngs.params(), (self.channels, kernel), pd), ("heads", None))
        self.dt_bias = param(jnp.ones((value_heads,), pd), (None,))
        self.A_log = param(jnp.log(jnp.linspace(1.0, 16.0, value_heads)).astype(pd), (None,))
        self.norm = param(jnp.ones((value_dim,), pd), (None,))
        self.out_proj = param(init(rngs.params(), (value_heads * value_dim, D), pd), ("heads", "embed"))
        self.eps = eps
        self.dtype = jnp.dtype(dtype)
        # LoRA adapters, attached by models.lora.apply_lora
        self.in_proj_qkv_lora = self.in_proj_z_lora = self.in_proj_b_lora = nnx.data(None)
        self.in_proj_a_lora = self.out_proj_lora = nnx.data(None)

    def _project(self, name: str, x):
        """x @ the projection `name` (+ its LoRA adapter's update)."""
        y = x @ getattr(self, name)[...].astype(x.dtype)
        lo = getattr(self, name + "_lora")
        return y if lo is None else y + lo(x)

    def _project_inputs(self, x):
        """x @ in_proj_qkv, _z, _b, _a (+ their LoRA updates): one product over the four weights side by side
        (a decode step of the tiny benchmark model: 4 dots -> 1, -7 %), unless the active mesh's rules split their
        heads (tensor parallelism): the concatenation would move columns between devices, so four products.
        (Weights sharded without an active mesh still give the same result, through a resharding.)"""
        from posttrain.sharding import active_mesh

        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        active = active_mesh()
        if active is not None:  # the mesh axes the rules put the heads on
            mesh, rules = active
            heads = rules.get("heads") or ()
            if any(mesh.shape.get(a, 1) > 1 for a in ((heads,) if isinstance(heads, str) else heads)):
                return tuple(self._project(n, x) for n in names)
        ws = [getattr(self, n)[...].astype(x.dtype) for n in names]
        ys = jnp.split(x @ jnp.concatenate(ws, axis=1), np.cumsum([w.shape[1] for w in ws])[:-1].tolist(), axis=-1)
        return tuple(y if getattr(self, n + "_lora") is None else y + getattr(self, n + "_lora")(x)
                     for n, y in zip(names, ys))

    def init_state(self, batch: int) -> LinearState:
        return LinearState(jnp.zeros((batch, self.K - 1, self.channels), self.dtype),
                           jnp.zeros((batch, self.Hv, self.Dk, self.Dv), jnp.float32))

    def __call__(self, x, state: Optional[LinearState] = None, valid=None, segments=None, branches=None, *,
                 chunk: Optional[int] = None):
        """x [B, T, D] -> (y [B, T, D], the state after the last token). state: carried in (a cache), else a
        sequence start. valid [B, T] bool: padding tokens (False) enter as zeros (as HF's padding mask) and
        leave the delta-rule state unchanged, so left padding is exact. segments [B, T] int or None: packed
        sequences (without a carried state); each starts from a zero state and convolution. branches [B, T] int
        or None: prefix-shared rows (one sequence per row, without a carried state): every branch starts from the
        prompt's state and convolution inputs (a first pass over the prompt alone gives its state). One token
        uses the recurrent form, more the chunked one."""
        chunk = chunk or chunk_for(x.shape[1])
        if branches is not None and state is not None:
            raise ValueError("GatedDeltaNet: branch ids with a carried state (a cache) are not supported")
        dt = self.dtype
        B, T, _ = x.shape
        carried = state is not None
        state = self.init_state(B) if state is None else state
        x = x.astype(dt)
        if valid is not None:
            x = x * valid[..., None].astype(dt)
        mixed, z, b, a = self._project_inputs(x)
        z = z.reshape(B, T, self.Hv, self.Dv)
        if carried and valid is not None:  # padding (a left-padded block, a stopped row) skips the conv window
            mixed, conv_state = valid_conv(mixed, self.conv[...], state.conv, valid)
        elif branches is None:
            mixed, conv_state = causal_conv(mixed, self.conv[...], state.conv, segments)
        else:
            mixed, conv_state = branch_conv(mixed, self.conv[...], branches), state.conv
        mixed = jax.nn.silu(mixed)
        grouped = mixed.reshape(B, T, self.Hk, self.channels // self.Hk)  # per key head [q | k | its v heads]
        q, k = grouped[..., :self.Dk], grouped[..., self.Dk:2 * self.Dk]
        v = grouped[..., 2 * self.Dk:].reshape(B, T, self.Hv, self.Dv)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        if valid is not None:
            beta, g = beta * valid[..., None], g * valid[..., None]
        if self.Hv > self.Hk:  # HF's repeat_interleave: value head h reads key head h // (Hv / Hk)
            q, k = (jnp.repeat(t, self.Hv // self.Hk, axis=2) for t in (q, k))
        if branches is not None:
            prompt = (branches == 0)[..., None].astype(g.dtype)  # pass 1: the prompt's state (branches skipped)
            _, s_prompt = chunked(q, k, v, g * prompt, beta * prompt, None, chunk=chunk)
            resets = jnp.concatenate([jnp.zeros((B, 1), bool), branches[:, 1:] != branches[:, :-1]], axis=1)
            o, rec = chunked(q, k, v, g, beta, None, chunk=chunk, resets=resets, restart=s_prompt)
        elif T == 1:
            o, rec = recurrent(q, k, v, g, beta, state.recurrent)
        else:
            resets = None if segments is None else jnp.concatenate(
                [jnp.zeros((B, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
            o, rec = chunked(q, k, v, g, beta, state.recurrent, chunk=chunk, resets=resets)
        o = rms_normalize_f32(o, self.eps).astype(dt) * self.norm[...].astype(dt)  # HF's Qwen3_5RMSNormGated
        o = (o.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(dt)
        y = self._project("out_proj", o.reshape(B, T, self.Hv * self.Dv))
        return y, LinearState(conv_state, rec)


def grouped_channels(key_heads: int, value_heads: int, key_dim: int, value_dim: int):
    """The HF channel of each of our in_proj_qkv / conv channels: ours = HF[..., perm] (HF: [all q | all k | all
    v]; ours: per key head g [q_g | k_g | v_g], v_g the value heads g r .. g r + r - 1, r = value / key heads)."""
    Hk, Dk, rv = key_heads, key_dim, value_heads // key_heads * value_dim
    return np.concatenate([np.concatenate([g * Dk + np.arange(Dk), (Hk + g) * Dk + np.arange(Dk),
                                           2 * Hk * Dk + g * rv + np.arange(rv)]) for g in range(Hk)])


def rms_normalize_f32(x, eps: float):
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)

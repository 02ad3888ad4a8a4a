"""The gated delta rule (Gated DeltaNet, Yang et al. 2024, arXiv 2412.06464), the recurrence of Qwen3.5 /
Qwen3-Next linear-attention layers, in two exact forms.

Per head, with a state S [Dk, Dv] (zero, or carried in), for each token t:
  S <- exp(g_t) S                                   (gated decay; g_t <= 0 is a log decay)
  S <- S + k_t (beta_t (v_t - S^T k_t))^T           (the delta rule: write the error of S's prediction)
  o_t = S^T q_t
with q and k L2-normalised (eps 1e-6) and q scaled by Dk^-1/2, as transformers' `torch_recurrent_gated_delta_rule`
/ `torch_chunk_gated_delta_rule` (use_qk_l2norm_in_kernel=True) and the FLA kernels they stand for.

- `recurrent(...)`: a scan over tokens: the decode step (one token) and the reference.
- `chunked(...)`: the WY / UT form over chunks of C tokens (training and prefill): inside a chunk the C updates
  are one triangular solve, (I + L)^-1 with L = strictly-lower(diag(beta) K K^T * decay), and matrix products;
  between chunks one state update. The scan over chunks rematerialises each chunk in the backward pass, so
  training memory is linear in length (tests/test_deltanet.py: temporaries 2048 -> 8192 tokens).
Both take q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta [B, T, H] (float32 inside) and an optional state
[B, H, Dk, Dv]; both return (o [B, T, H, Dv] in v's dtype, final state float32). Tokens with g = 0 and
beta = 0 leave the state unchanged (padding).

What it is not (yet): the Gated DeltaNet layer (projections, the causal depthwise convolution, the gated
output norm), its cache in the sampler, or prefix-shared rows for linear layers; issue #36 wires those.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(sum x^2 + eps) over the last axis (FLA's and transformers' l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, normalize: bool):
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    if normalize:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent(q, k, v, g, beta, state: Optional[jax.Array] = None, *, normalize: bool = True):
    """The gated delta rule token by token (see the module docstring)."""
    dt = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, normalize)
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    s0 = jnp.zeros((B, H, Dk, Dv), jnp.float32) if state is None else state.astype(jnp.float32)

    def step(s, x):
        qt, kt, vt, gt, bt = x  # [B, H, ...]
        s = s * jnp.exp(gt)[..., None, None]
        err = (vt - jnp.einsum("bhkv,bhk->bhv", s, kt)) * bt[..., None]
        s = s + kt[..., :, None] * err[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, qt)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    s, o = jax.lax.scan(step, s0, xs)
    return jnp.moveaxis(o, 0, 1).astype(dt), s


def chunked(q, k, v, g, beta, state: Optional[jax.Array] = None, *, chunk: int = 64, normalize: bool = True):
    """The gated delta rule in chunks of `chunk` tokens (see the module docstring)."""
    dt = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, normalize)
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk
    pad = -T % C
    if pad:  # padded tokens: g = 0, beta = 0, k = 0: the state passes through unchanged
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    n = (T + pad) // C

    def split(x):  # [B, T, H, ...] -> [n, B, H, C, ...]
        x = x.reshape((B, n, C, H) + x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

    qc, kc, vc, gc, bc = (split(x) for x in (q, k, v, g, beta))
    s0 = jnp.zeros((B, H, Dk, Dv), jnp.float32) if state is None else state.astype(jnp.float32)
    lower = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    eye = jnp.eye(C, dtype=jnp.float32)

    @jax.checkpoint
    def body(s, x):
        qi, ki, vi, gi, bi = x  # [B, H, C, ...]
        gi = jnp.cumsum(gi, axis=-1)  # log decay from the chunk start, inclusive
        decay = jnp.where(lower, jnp.exp(jnp.where(lower, gi[..., :, None] - gi[..., None, :], 0.0)), 0.0)
        kb = ki * bi[..., None]
        low = jnp.where(strict, jnp.einsum("bhik,bhjk->bhij", kb, ki) * decay, 0.0)
        # (I + L)^-1 applied to [beta v | beta k exp(g)]: the chunk's C delta-rule updates at once
        rhs = jnp.concatenate([vi * bi[..., None], kb * jnp.exp(gi)[..., None]], axis=-1)
        solved = jax.scipy.linalg.solve_triangular(eye + low, rhs, lower=True, unit_diagonal=True)
        u, w = solved[..., :Dv], solved[..., Dv:]
        v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, s)
        attn = jnp.where(lower, jnp.einsum("bhik,bhjk->bhij", qi, ki) * decay, 0.0)
        out = jnp.einsum("bhck,bhkv->bhcv", qi * jnp.exp(gi)[..., None], s) + attn @ v_new
        last = gi[..., -1]
        s = s * jnp.exp(last)[..., None, None] + jnp.einsum(
            "bhck,bhcv->bhkv", ki * jnp.exp(last[..., None] - gi)[..., None], v_new)
        return s, out

    s, o = jax.lax.scan(body, s0, (qc, kc, vc, gc, bc))  # o [n, B, H, C, Dv]
    o = jnp.moveaxis(o, 0, 1).swapaxes(2, 3).reshape(B, n * C, H, Dv)[:, :T]
    return o.astype(dt), s

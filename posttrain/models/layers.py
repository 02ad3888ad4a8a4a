"""Transformer building blocks: RMSNorm, RoPE, grouped-query attention with a KV cache, gated MLP
(the mixture-of-experts block that replaces it on sparse layers is in moe.py).

What it is: the numerics of the decoder layer, written to match Hugging Face transformers
(float32 RMSNorm, rotate-half RoPE with default/linear/llama3 scaling, Gemma's (1 + w) norms,
score and logit soft-capping, sliding windows). What it is not: a model; `transformer.py` wires
these together from a ModelConfig.

Einsum legend: B batch, T query length, S key length, D embed, N query heads, K kv heads,
G query heads per kv head (N = K * G), H head dim, F mlp, V vocab.

Layout choices (../shared/PERF_NOTES.md): q, k and v come from ONE fused projection laid out
[D, K, G + 2, H] (per kv head: its G query heads, then k, then v), so GQA needs no repeat and
the kv-head axis shards cleanly for tensor parallelism; gate and up are one [D, 2, F]
projection; the KV cache is [B, K, S, H] so the attention einsums need no transpose.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.models.attention import attention
from posttrain.models.config import ModelConfig, RopeConfig
from posttrain.sharding import constrain, param


class RMSNorm(nnx.Module):
    """y = x / rms(x) * w, or * (1 + w) for Gemma; statistics in float32 as in HF."""

    def __init__(self, dim: int, *, eps: float, unit_offset: bool, param_dtype, names=("embed",)):
        init = jnp.zeros if unit_offset else jnp.ones
        self.scale = param(init((dim,), param_dtype), names)
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = self.scale[...].astype(jnp.float32)
        if self.unit_offset:
            w = 1.0 + w
        return (y * w).astype(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [H/2] (float32), with HF's linear or llama3 scaling."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv = inv.astype(np.float32)
    if rope.kind == "linear":
        inv = inv / rope.factor
    elif rope.kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_cos_sin(positions, rope: RopeConfig, head_dim: int):
    """(cos, sin), each [B, T, H] float32, for positions [B, T] int (shared by every layer using `rope`)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(rope, head_dim))  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos_sin):
    """Rotate-half RoPE. x: [B, T, ..., H]; cos_sin: from `rope_cos_sin`, each [B, T, H]."""
    cos, sin = cos_sin
    extra = x.ndim - 3  # head axes between T and H
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[-1:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[-1:])
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    xf = x.astype(jnp.float32)
    return (xf * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def split(x, axis: int, sizes: tuple):
    """Slices of `x` along `axis`; the backward pass is ONE concatenate of the cotangents.

    Why: a fused projection (qkv, gate/up) is split into its parts. Plain slicing differentiates
    into one zero-padded full-size array per part plus their sum, which on CPU cost more than the
    matmuls themselves (profiled: ~1/3 of the train step). Concatenating writes each value once.
    """
    out, start = [], 0
    for n in sizes:
        out.append(jax.lax.slice_in_dim(x, start, start + n, axis=axis))
        start += n
    return tuple(out)


def _split_fwd(x, axis, sizes):
    return split(x, axis, sizes), None


def _split_bwd(axis, sizes, _, cts):
    return (jnp.concatenate(cts, axis=axis),)


split.defvjp(_split_fwd, _split_bwd)


def lora_update(module, name: str, x):
    """The LoRA adapter's contribution for projection `name` of `module`, or None (see lora.py)."""
    lo = getattr(module, name + "_lora", None)
    return None if lo is None else lo(x)


class Attention(nnx.Module):
    """Grouped-query self-attention of one layer; reads and writes that layer's KV cache."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        D, K, G, H = cfg.embed_dim, cfg.num_kv_heads, cfg.groups, cfg.head_dim
        pd = jnp.dtype(cfg.param_dtype)
        init = nnx.initializers.normal(0.02)
        self.qkv = param(init(rngs.params(), (D, K, G + 2, H), pd), ("embed", "kv_heads", None, "head_dim"))
        self.qkv_bias = (param(jnp.zeros((K, G + 2, H), pd), ("kv_heads", None, "head_dim"))
                         if cfg.qkv_bias else None)
        self.o = param(init(rngs.params(), (K, G, H, D), pd), ("kv_heads", None, "head_dim", "embed"))
        if cfg.qk_norm:
            norm = dict(eps=cfg.norm_eps, unit_offset=cfg.norm_unit_offset, param_dtype=pd, names=("head_dim",))
            self.q_norm, self.k_norm = RMSNorm(H, **norm), RMSNorm(H, **norm)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_lora = self.o_lora = nnx.data(None)  # LoRA adapters, attached by models.lora.apply_lora
        self.groups = G
        self.dtype = jnp.dtype(cfg.dtype)
        self.scale = cfg.query_scale if cfg.query_scale is not None else H ** -0.5
        self.attn_softcap = cfg.attn_softcap
        self.window = cfg.layer_window(layer)

    def __call__(self, x, rope, layout, kv=None, write_index=None, return_attn=False):
        """x [B,T,D], rope: this layer's (cos, sin) from `rope_cos_sin`, layout: the masking inputs (attention.py).

        kv: this layer's cache (k, v), each [B,K,S,H], or None to attend within x only.
        Returns (y [B,T,D], new kv or None, probs [B,N,T,S] or None).
        """
        G, dt = self.groups, self.dtype
        x = x.astype(dt)
        qkv = jnp.einsum("btd,dkch->btkch", x, self.qkv[...].astype(dt))
        if (d := lora_update(self, "qkv", x)) is not None:
            qkv = qkv + d
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias[...].astype(dt)
        q, k, v = split(qkv, 3, (G, 1, 1))
        k, v = k[:, :, :, 0], v[:, :, :, 0]  # q [B,T,K,G,H]; k, v [B,T,K,H]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
        q = constrain(q, ("batch", "seq", "kv_heads", None, "head_dim"))
        k = jnp.swapaxes(k, 1, 2)  # [B,K,T,H]
        v = jnp.swapaxes(v, 1, 2)
        if kv is not None:
            zero = jnp.zeros((), jnp.int32)
            idx = (zero, zero, write_index, zero)
            k = jax.lax.dynamic_update_slice(kv[0], k.astype(kv[0].dtype), idx)
            v = jax.lax.dynamic_update_slice(kv[1], v.astype(kv[1].dtype), idx)
            kv = (k, v)
        out, probs = attention(q, k, v, layout, window=self.window, scale=self.scale, cap=self.attn_softcap,
                               return_probs=return_attn)
        b, t = out.shape[:2]  # one 2-D matmul: lets XLA keep the weight's layout (no per-call transpose)
        o = self.o[...].astype(dt)
        y = out.reshape(b, t, -1) @ o.reshape(-1, o.shape[-1])
        if (d := lora_update(self, "o", out)) is not None:
            y = y + d
        attn = None
        if return_attn:
            b, kh, g, t, s = probs.shape
            attn = probs.reshape(b, kh * g, t, s)
        return y, kv, attn


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (tanh-approximate gelu)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, F = cfg.embed_dim, cfg.mlp_dim
        pd = jnp.dtype(cfg.param_dtype)
        init = nnx.initializers.normal(0.02)
        self.gate_up = param(init(rngs.params(), (D, 2, F), pd), ("embed", None, "mlp"))
        self.down = param(init(rngs.params(), (F, D), pd), ("mlp", "embed"))
        self.gate_up_lora = self.down_lora = nnx.data(None)  # LoRA adapters, attached by models.lora.apply_lora
        self.act = jax.nn.silu if cfg.activation == "silu" else (lambda z: jax.nn.gelu(z, approximate=True))
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x):
        dt = self.dtype
        x = x.astype(dt)
        h = jnp.einsum("btd,dcf->btcf", x, self.gate_up[...].astype(dt))
        if (d := lora_update(self, "gate_up", x)) is not None:
            h = h + d
        gate, up = split(h, 2, (1, 1))
        h = constrain(self.act(gate[:, :, 0]) * up[:, :, 0], ("batch", "seq", "mlp"))
        y = jnp.einsum("btf,fd->btd", h, self.down[...].astype(dt))
        if (d := lora_update(self, "down", h)) is not None:
            y = y + d
        return y


class Block(nnx.Module):
    """One decoder layer: pre-norm attention and MLP residuals (Gemma 2/3 add post-norms)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        norm = dict(eps=cfg.norm_eps, unit_offset=cfg.norm_unit_offset, param_dtype=jnp.dtype(cfg.param_dtype))
        D = cfg.embed_dim
        self.attn_norm = RMSNorm(D, **norm)
        self.attn = Attention(cfg, layer, rngs=rngs)
        self.mlp_norm = RMSNorm(D, **norm)
        if cfg.is_moe_layer(layer):
            from posttrain.models.moe import MoE

            self.mlp = MoE(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg, rngs=rngs)
        if cfg.sandwich_norm:
            self.post_attn_norm, self.post_mlp_norm = RMSNorm(D, **norm), RMSNorm(D, **norm)
        else:
            self.post_attn_norm = self.post_mlp_norm = None
        self.rope = cfg.layer_rope(layer)  # static: the Transformer passes this RopeConfig's (cos, sin)

    def __call__(self, x, rope, layout, kv=None, write_index=None, return_attn=False):
        """Returns (x, kv, attention probabilities or None, router logits [B, T, E] or None: dense MLP)."""
        h, kv, attn = self.attn(self.attn_norm(x), rope, layout, kv, write_index, return_attn)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h, router = self.mlp(self.mlp_norm(x)), None
        if isinstance(h, tuple):  # mixture of experts (models/moe.py)
            h, router = h
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        x = constrain(x + h, ("batch", "seq", "embed"))
        return x, kv, attn, router

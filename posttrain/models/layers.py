"""Transformer building blocks: RMSNorm, RoPE, grouped-query attention with a KV cache, gated MLP
(the mixture-of-experts block that replaces it on sparse layers, or runs beside it, is in moe.py;
the decoder layer that combines them, `Block`, is in transformer.py).

What it is: the numerics of the decoder layer, written to match Hugging Face transformers
(float32 RMSNorm, rotate-half RoPE with default/linear/llama3/proportional scaling, Gemma's (1 + w)
norms, score and logit soft-capping, sliding windows), with Gemma 4's per-layer variants: a layer's
own head size and kv heads, keys as values, KV-shared layers that attend an earlier layer's keys and
values, value norms, per-layer input embeddings and a loaded layer scalar. What it is not: a model;
`transformer.py` wires these together from a ModelConfig. This module imports neither moe.py nor
transformer.py (both import it).

Einsum legend: B batch, T query length, S key length, D embed, N query heads, K kv heads,
G query heads per kv head (N = K * G), H head dim, F mlp, V vocab.

Layout choices (docs/perf_notes.md): q, k and v come from ONE fused projection laid out
[D, K, G + 2, H] (per kv head: its G query heads, then k, then v; G + 1 without v when keys are
values, G for a KV-shared layer, which projects queries only), so GQA needs no repeat and
the kv-head axis shards cleanly for tensor parallelism; gate and up are one [D, 2, F]
projection; the KV cache is [B, K, S, H] so the attention einsums need no transpose.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.models import kv_store
from posttrain.models.attention import attention, pack_heads
from posttrain.models.config import ModelConfig, RopeConfig
from posttrain.sharding import constrain, param


class Buffer(nnx.Variable):
    """A loaded tensor that is never trained (a Hugging Face buffer, e.g. Gemma 4's `layer_scalar`):
    not an `nnx.Param`, so the trainer leaves it frozen and parameter counts leave it out, as in HF."""


def rms_normalize(x, eps: float):
    """x / rms(x) over the last axis, statistics in float32 (HF's norms without a scale, Gemma 4 v_norm)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """y = x / rms(x) * w, or * (1 + w) for Gemma; statistics in float32 as in HF."""

    def __init__(self, dim: int, *, eps: float, unit_offset: bool, param_dtype, names=("embed",)):
        init = jnp.zeros if unit_offset else jnp.ones
        self.scale = param(init((dim,), param_dtype), names)
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x):
        y = rms_normalize(x.astype(jnp.float32), self.eps)
        w = self.scale[...].astype(jnp.float32)
        if self.unit_offset:
            w = 1.0 + w
        return (y * w).astype(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [H/2] (float32), with HF's linear, llama3 or proportional scaling."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv = inv.astype(np.float32)
    if rope.kind == "proportional":
        # Gemma 4 global layers: the first partial * H/2 pairs rotate at the full head's frequencies,
        # the other pairs get frequency 0 (cos 1, sin 0: not rotated); as transformers' proportional RoPE.
        rotated = int(rope.partial * head_dim // 2)
        inv = np.concatenate([inv[:rotated], np.zeros(head_dim // 2 - rotated, np.float32)]) / rope.factor
    elif rope.kind == "linear":
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
    elif rope.kind == "yarn":
        # YaRN (arXiv 2309.00071) as transformers' _compute_yarn_parameters: interpolate (divide by `factor`)
        # the low frequencies, extrapolate the high ones, a linear ramp between the correction dimensions.
        def corr(rot):
            return head_dim * math.log(rope.original_max_position / (rot * 2 * math.pi)) / (2 * math.log(rope.theta))

        lo, hi = corr(rope.beta_fast), corr(rope.beta_slow)
        if rope.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1).astype(np.float32)
        extrapolate = 1 - ramp
        inv = (inv / rope.factor * (1 - extrapolate) + inv * extrapolate).astype(np.float32)
    return inv


def rope_scale(rope: RopeConfig) -> float:
    """The factor on cos and sin (YaRN's attention factor; 1 otherwise), as transformers' attention_scaling."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    return 1.0 if rope.factor <= 1 else 0.1 * math.log(rope.factor) + 1.0


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """How many of a head's H dimensions rotate: H, or partial * H for a partial default RoPE (Qwen3.5: the first
    partial * H dimensions rotate as a head of that size, the rest pass through)."""
    return int(head_dim * rope.partial) if rope.kind != "proportional" and rope.partial < 1 else head_dim


def rope_cos_sin(positions, rope: RopeConfig, head_dim: int):
    """(cos, sin), each [B, T, R] float32 (R = `rotary_dim`, H unless partial), for positions [B, T] int (shared
    by every layer using `rope`); positions [3, B, T]: interleaved M-RoPE (`RopeConfig.mrope_section`), whose
    tables are computed once on a CPU (`computed_once`); 1-D positions keep the plain computation."""
    if positions.ndim == 3:
        return computed_once(functools.partial(_rope_tables, rope=rope, head_dim=head_dim), positions)
    return _rope_tables(positions, rope, head_dim)


def computed_once(fn, x):
    """fn(x) (x an int array), on a CPU as the outputs of a `lax.cond` whose two branches are both fn: XLA's CPU
    fusion otherwise recomputes an elementwise table such as RoPE's cos / sin inside every consumer (each head and
    layer, forward and backward: scalar transcendentals each time) and drops `optimization_barrier`; a
    conditional's outputs are buffers computed once. Same values. Other backends, or an empty x: fn(x) (a GPU's
    conditional waits on its predicate). Used for M-RoPE and the vision tower's 2-D RoPE only: the text models'
    1-D tables keep the fused computation, so their CPU round-off is unchanged."""
    if jax.default_backend() != "cpu" or x.size == 0:
        return fn(x)
    return jax.lax.cond(x.reshape(-1)[0] >= 0, fn, fn, x)


def _rope_tables(positions, rope: RopeConfig, head_dim: int):
    head_dim = rotary_dim(rope, head_dim)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(rope, head_dim))  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if positions.ndim == 3:  # mix the angles, then one cos / sin per element (the same values as mixing after):
        emb = mrope_mix(rope, emb)  # XLA fuses the tables into every consumer, so 3 axes cost 3x there
    scale = rope_scale(rope)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scale != 1.0:
        return cos * scale, sin * scale
    return cos, sin


def rope_lookup(rope: RopeConfig, cos, sin, positions):
    """(cos, sin) of `positions` ([B, T], or [3, B, T] for M-RoPE) from tables [L, R] of positions 0 .. L - 1."""
    c, s = jnp.take(cos, positions, axis=0), jnp.take(sin, positions, axis=0)
    return (mrope_mix(rope, c), mrope_mix(rope, s)) if positions.ndim == 3 else (c, s)


def mrope_mix(rope: RopeConfig, x):
    """Interleaved M-RoPE (transformers' Qwen3-VL apply_interleaved_mrope): [3, ..., R] tables of the temporal,
    height and width positions -> [..., R], column j taken from the axis that rotates frequency j % (R / 2)."""
    half = x.shape[-1] // 2
    axis = np.zeros(half, np.int32)
    for a in (1, 2):
        n = rope.mrope_section[a] * 3 if rope.mrope_section else 0
        axis[a:n:3] = a
    axis = np.concatenate([axis, axis])
    return jnp.where(axis == 1, x[1], jnp.where(axis == 2, x[2], x[0]))


def apply_rope(x, cos_sin):
    """Rotate-half RoPE. x: [B, T, ..., H]; cos_sin: from `rope_cos_sin`, each [B, T, R]: R < H rotates the first
    R dimensions (rotate-half within them) and passes the rest through."""
    cos, sin = cos_sin
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return jnp.concatenate([apply_rope(x[..., :r], cos_sin), x[..., r:]], axis=-1)
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


PLAIN_WEIGHT_GRADS = True  # False: plain autodiff of x @ w everywhere (for A/B runs)


def project(x, w):
    """x [..., K] @ w [K, N]. On a CPU its weight gradient is ONE plain product x^T [K, M] @ g [M, N], x^T
    materialised first: as JAX differentiates x @ w, XLA:CPU contracts both operands over their token axis
    (x [M, K] and g laid out [N, M]), which Eigen ran at half speed (lm_head [2048, 256] x [2048, 2048]: 96 -> 52
    ms CPU alone). Same products and block sizes, so the same bits (tests/test_models.py checks). When x is wider
    than g (the MLP's down: x [M, 1024], g [M, 256]), (g^T @ x)^T instead: XLA fused x's producer (act(gate) * up)
    into x's transposed copy, a strided loop (16 ms a layer in the tiny Qwen3-VL step, 1.2 ms for the transpose
    alone); g^T is 4x smaller. Bitwise the same weights after 8 AdamW steps of that model; the step 3-4 % faster (docs/
    benchmarks.md, "Ninth stop"). Other backends, or PLAIN_WEIGHT_GRADS False: x @ w."""
    if not PLAIN_WEIGHT_GRADS or jax.default_backend() != "cpu":
        return x @ w
    lead = x.shape[:-1]
    return _plain(x.reshape(-1, x.shape[-1]), w).reshape(*lead, w.shape[-1])


@jax.custom_vjp
def _plain(x, w):
    return x @ w


def _plain_fwd(x, w):
    return x @ w, (x, w)


def _plain_bwd(res, g):
    x, w = res
    dx = jax.lax.dot_general(g, w, (((1,), (1,)), ((), ())))  # g @ w^T, as autodiff writes it
    if x.shape[1] > g.shape[1]:  # the narrower one transposed: (g^T @ x)^T (the MLP's down: g [M, 256], x [M, 1024])
        gt = jax.lax.optimization_barrier(jnp.transpose(g))
        return dx, jnp.transpose(jax.lax.optimization_barrier(gt @ x))
    xt = jax.lax.optimization_barrier(jnp.transpose(x))  # kept apart: XLA would fold it back into the product
    return dx, xt @ g


_plain.defvjp(_plain_fwd, _plain_bwd)


def lora_update(module, name: str, x):
    """The LoRA adapter's contribution for projection `name` of `module`, or None (see lora.py)."""
    lo = getattr(module, name + "_lora", None)
    return None if lo is None else lo(x)


def cache_write(cache, x, write_index, layer=None):
    """x [B, K, T, H] written at slot `write_index` of a layer's cache [B, K', S, P*H] (P heads a row: attention.
    pack_heads on a TPU), or of layer `layer` of stacked caches [L, B, K', S, P*H] (scanned layers), in place."""
    P = cache.shape[-1] // x.shape[-1]
    zero = jnp.zeros((), jnp.int32)
    x = pack_heads(x, P)
    if layer is None:  # converted to the cache's storage (models/kv_store.py: a cast, float8 saturated, or int8)
        return kv_store.write(cache, x, (zero, zero, write_index, zero))
    return kv_store.write(cache, x[None], (layer, zero, zero, write_index, zero))


def stacked_cache_write(kv, k, v, write_index):
    """Scanned layers (models/scan.py): kv = (keys, values, layer), the caches of every layer [L, B, K', S, P*H]
    and this layer's index. Writes k, v [B, K, T, H] at slot `write_index` of that layer in place (the stacked
    caches are the scan's carry: no layer's cache is copied whole) and returns (the updated caches, this layer's
    keys and values to attend)."""
    ks, vs, layer = kv
    ks, vs = cache_write(ks, k, write_index, layer), cache_write(vs, v, write_index, layer)
    one = functools.partial(jax.tree.map, functools.partial(jax.lax.dynamic_index_in_dim, index=layer, axis=0,
                                                           keepdims=False))
    return (ks, vs), one(ks), one(vs)


class Attention(nnx.Module):
    """Grouped-query self-attention of one layer; reads and writes that layer's KV cache.

    Per layer (ModelConfig.layer_*): K kv heads of width H; `kv_slots` of the fused projection after the
    G query heads: 2 (k, v), 1 (k only: values are the raw keys, Gemma 4 k_eq_v) or 0 (a KV-shared layer:
    it attends the keys and values of `cfg.kv_source(layer)`, passed in as `shared`)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        D, K, H = cfg.embed_dim, cfg.layer_kv_heads(layer), cfg.layer_head_dim(layer)
        G = cfg.num_heads // K
        self.kv_slots = cfg.layer_kv_slots(layer)
        pd = jnp.dtype(cfg.param_dtype)
        init = nnx.initializers.normal(0.02)
        self.gated = cfg.attn_output_gate  # Qwen3.5: G more query-sized slots, the output gate
        C = G * (2 if self.gated else 1) + self.kv_slots
        self.qkv = param(init(rngs.params(), (D, K, C, H), pd), ("embed", "kv_heads", None, "head_dim"))
        self.qkv_bias = param(jnp.zeros((K, C, H), pd), ("kv_heads", None, "head_dim")) if cfg.qkv_bias else None
        self.o = param(init(rngs.params(), (K, G, H, D), pd), ("kv_heads", None, "head_dim", "embed"))
        self.o_bias = param(jnp.zeros((D,), pd), ("embed",)) if cfg.o_bias else None
        self.sinks = param(jnp.zeros((K, G), pd), ("kv_heads", None)) if cfg.attn_sinks else None  # GPT-OSS
        norm = dict(eps=cfg.norm_eps, unit_offset=cfg.norm_unit_offset, param_dtype=pd, names=("head_dim",))
        self.q_norm = RMSNorm(H, **norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(H, **norm) if cfg.qk_norm and self.kv_slots else None
        self.v_norm_eps = cfg.norm_eps if cfg.v_norm else None
        self.qkv_lora = self.o_lora = nnx.data(None)  # LoRA adapters, attached by models.lora.apply_lora
        self.groups = G
        self.dtype = jnp.dtype(cfg.dtype)
        self.scale = cfg.query_scale if cfg.query_scale is not None else H ** -0.5
        self.attn_softcap = cfg.attn_softcap
        self.window = cfg.layer_window(layer)

    def __call__(self, x, rope, layout, kv=None, write_index=None, return_attn=False, shared=None):
        """x [B,T,D], rope: this layer's (cos, sin) from `rope_cos_sin`, layout: the masking inputs (attention.py).

        kv: this layer's cache (k, v), each [B,K,S,H], or None to attend within x only. Scanned layers pass
        (k, v, layer) of the stacked [L, ...] caches (`stacked_cache_write`) and get the stacked caches back.
        shared: a KV-shared layer's keys and values (what its source layer attended), else None.
        Returns (y [B,T,D], the (k, v) attended: the updated cache with one, else x's own [B,K,T,H];
        None for a KV-shared layer, probs [B,N,T,S] or None).
        """
        G, dt = self.groups, self.dtype
        x = x.astype(dt)
        qkv = jnp.einsum("btd,dkch->btkch", x, self.qkv[...].astype(dt))
        if (d := lora_update(self, "qkv", x)) is not None:
            qkv = qkv + d
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias[...].astype(dt)
        if self.gated:
            q, gate, *kv_new = split(qkv, 3, (G, G) + (1,) * self.kv_slots)  # q, gate [B,T,K,G,H]
        else:
            q, *kv_new = split(qkv, 3, (G,) + (1,) * self.kv_slots)  # q [B,T,K,G,H]
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = constrain(apply_rope(q, rope), ("batch", "seq", "kv_heads", None, "head_dim"))
        if self.kv_slots:
            k = kv_new[0][:, :, :, 0]  # [B,T,K,H]
            v = kv_new[1][:, :, :, 0] if self.kv_slots == 2 else k  # keys as values: the raw projection
            if self.k_norm is not None:
                k = self.k_norm(k)
            if self.v_norm_eps is not None:
                v = rms_normalize(v, self.v_norm_eps)
            k = jnp.swapaxes(apply_rope(k, rope), 1, 2)  # [B,K,T,H]
            v = jnp.swapaxes(v, 1, 2)
            if kv is not None and len(kv) == 3:  # layer kv[2] of stacked [L, ...] caches (scanned layers)
                kv, k, v = stacked_cache_write(kv, k, v, write_index)
            else:
                if kv is not None:  # this layer's cache (maybe P heads a row)
                    k, v = cache_write(kv[0], k, write_index), cache_write(kv[1], v, write_index)
                kv = (k, v)
        else:
            (k, v), kv = shared, None
        k, v = kv_store.load(k, dt), kv_store.load(v, dt)  # an int8 cache dequantized (any other: attention casts)
        out, probs = attention(q, k, v, layout, window=self.window, scale=self.scale, cap=self.attn_softcap,
                               return_probs=return_attn, sinks=None if self.sinks is None else self.sinks[...])
        if self.gated:
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        b, t = out.shape[:2]  # one 2-D matmul: lets XLA keep the weight's layout (no per-call transpose)
        o = self.o[...].astype(dt)
        y = project(out.reshape(b, t, -1), o.reshape(-1, o.shape[-1]))
        if (d := lora_update(self, "o", out)) is not None:
            y = y + d
        if self.o_bias is not None:
            y = y + self.o_bias[...].astype(dt)
        attn = None
        if return_attn:
            b, kh, g, t, s = probs.shape
            attn = probs.reshape(b, kh * g, t, s)
        return y, kv, attn


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (tanh-approximate gelu)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, width: Optional[int] = None):
        D, F = cfg.embed_dim, width or cfg.mlp_dim
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
        y = project(h, self.down[...].astype(dt))
        if (d := lora_update(self, "down", h)) is not None:
            y = y + d
        return y

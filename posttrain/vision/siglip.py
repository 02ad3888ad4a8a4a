"""The SigLIP vision tower (Flax NNX), as transformers 5.12's `SiglipVisionModel` without its pooling head (the
tower Gemma 3 uses: `vision_use_head: false`); forward only.

pixels [N, C, S, S] -> patch embedding (a stride-P convolution, here the patches flattened [C, P, P] times a
[C * P * P, D] matrix: the same sums) + learned position embeddings (one per patch, row-major) -> L encoder
layers (LayerNorm, multi-head self-attention over all patches with biased q/k/v/out projections and scale
head_dim^-1/2, residual; LayerNorm, fc1, tanh GELU, fc2, residual) -> the post LayerNorm: [N, (S / P)^2, D].
LayerNorm statistics and attention scores are float32, as transformers' (on CPU, float32 weights).

What it is not: the pooling head (`vision_use_head`), position-embedding interpolation for other image sizes
(`interpolate_pos_encoding`), the SigLIP text tower, or dropout. The projector into a language model is the VLM
family's (`vision/gemma3.py`). Weight names: `weight_names` (HF `embeddings.*`, `encoder.layers.<i>.*`,
`post_layernorm.*` under the folder's prefix).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.sharding import param


@dataclasses.dataclass(frozen=True, kw_only=True)
class SiglipConfig:
    """The vision tower's sizes (transformers' SiglipVisionConfig names in the comments)."""

    hidden_size: int = 1152  # hidden_size: D
    intermediate_size: int = 4304  # intermediate_size: the MLP width
    num_layers: int = 27  # num_hidden_layers
    num_heads: int = 16  # num_attention_heads
    image_size: int = 896  # image_size: pixels a side
    patch_size: int = 14  # patch_size: pixels a patch side (the convolution's kernel and stride)
    num_channels: int = 3  # num_channels
    eps: float = 1e-6  # layer_norm_eps
    param_dtype: str = "float32"  # weights
    dtype: str = "float32"  # activations

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    def replace(self, **kw) -> "SiglipConfig":
        return dataclasses.replace(self, **kw)


class LayerNorm(nnx.Module):
    """y = (x - mean) / sqrt(var + eps) * w + b, statistics in float32."""

    def __init__(self, dim: int, eps: float, param_dtype):
        self.scale = param(jnp.ones((dim,), param_dtype), (None,))
        self.bias = param(jnp.zeros((dim,), param_dtype), (None,))
        self.eps = eps

    def __call__(self, x):
        y = x.astype(jnp.float32)
        mean = y.mean(-1, keepdims=True)
        var = jnp.square(y - mean).mean(-1, keepdims=True)
        y = (y - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Dense(nnx.Module):
    """x @ w + b with w [in, out] (HF's Linear weight transposed)."""

    def __init__(self, n_in: int, n_out: int, param_dtype, rngs: nnx.Rngs):
        self.w = param(nnx.initializers.normal(0.02)(rngs.params(), (n_in, n_out), param_dtype), (None, None))
        self.b = param(jnp.zeros((n_out,), param_dtype), (None,))

    def __call__(self, x):
        return x @ self.w[...].astype(x.dtype) + self.b[...].astype(x.dtype)


class EncoderLayer(nnx.Module):
    def __init__(self, cfg: SiglipConfig, rngs: nnx.Rngs):
        D, F, pd = cfg.hidden_size, cfg.intermediate_size, jnp.dtype(cfg.param_dtype)
        self.num_heads = cfg.num_heads
        self.norm1 = LayerNorm(D, cfg.eps, pd)
        self.q, self.k, self.v, self.out = (Dense(D, D, pd, rngs) for _ in range(4))
        self.norm2 = LayerNorm(D, cfg.eps, pd)
        self.fc1 = Dense(D, F, pd, rngs)
        self.fc2 = Dense(F, D, pd, rngs)

    def __call__(self, x):
        N, L, D = x.shape
        n = self.num_heads
        h = self.norm1(x)
        q, k, v = (f(h).reshape(N, L, n, D // n) for f in (self.q, self.k, self.v))
        s = jnp.einsum("nlhd,nmhd->nhlm", q, k).astype(jnp.float32) * (D // n) ** -0.5
        p = jax.nn.softmax(s, axis=-1).astype(x.dtype)
        a = jnp.einsum("nhlm,nmhd->nlhd", p, v).reshape(N, L, D)
        x = x + self.out(a)
        h = self.fc2(jax.nn.gelu(self.fc1(self.norm2(x)), approximate=True))
        return x + h


class SiglipVision(nnx.Module):
    """pixels [N, C, S, S] (float, normalised: `vision.preprocess.gemma3_pixels`) -> [N, (S / P)^2, D]."""

    def __init__(self, cfg: SiglipConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        C, P, D, pd = cfg.num_channels, cfg.patch_size, cfg.hidden_size, jnp.dtype(cfg.param_dtype)
        self.patch = Dense(C * P * P, D, pd, rngs)  # HF conv weight [D, C, P, P] flattened and transposed
        self.pos = param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.num_patches, D), pd), (None, None))
        self.layers = nnx.List([EncoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
        self.post_norm = LayerNorm(D, cfg.eps, pd)

    def __call__(self, pixels):
        cfg = self.cfg
        N, C, H, W = pixels.shape
        P, g = cfg.patch_size, cfg.patches_per_side
        if (C, H, W) != (cfg.num_channels, cfg.image_size, cfg.image_size):
            raise ValueError(f"pixels {tuple(pixels.shape)}: the tower reads [N, {cfg.num_channels}, "
                             f"{cfg.image_size}, {cfg.image_size}]")
        x = pixels.astype(jnp.dtype(cfg.dtype)).reshape(N, C, g, P, g, P)
        x = x.transpose(0, 2, 4, 1, 3, 5).reshape(N, g * g, C * P * P)  # row-major patches, each [C, P, P]
        x = self.patch(x) + self.pos[...].astype(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.post_norm(x)


def weight_names(cfg: SiglipConfig, prefix: str) -> dict:
    """posttrain path (under the tower) -> (HF keys, load, save), as hf_names.weight_map's entries; `prefix` is
    where the folder keeps the tower (transformers 5.12's Gemma 3: "vision_tower.")."""
    ident = (lambda a: a, lambda a: [a])
    lin = (lambda w: w.T, lambda a: [a.T])
    D = cfg.hidden_size
    m = {("patch", "w"): ([prefix + "embeddings.patch_embedding.weight"], lambda w: w.reshape(D, -1).T,
                          lambda a: [np.ascontiguousarray(a.T).reshape(D, cfg.num_channels, cfg.patch_size,
                                                                       cfg.patch_size)]),
         ("patch", "b"): ([prefix + "embeddings.patch_embedding.bias"], *ident),
         ("pos",): ([prefix + "embeddings.position_embedding.weight"], *ident),
         ("post_norm", "scale"): ([prefix + "post_layernorm.weight"], *ident),
         ("post_norm", "bias"): ([prefix + "post_layernorm.bias"], *ident)}
    for i in range(cfg.num_layers):
        p, L = f"{prefix}encoder.layers.{i}.", ("layers", i)
        for ours, hf in (("norm1", "layer_norm1"), ("norm2", "layer_norm2")):
            m[L + (ours, "scale")] = ([p + hf + ".weight"], *ident)
            m[L + (ours, "bias")] = ([p + hf + ".bias"], *ident)
        for ours, hf in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                         ("out", "self_attn.out_proj"), ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
            m[L + (ours, "w")] = ([p + hf + ".weight"], *lin)
            m[L + (ours, "b")] = ([p + hf + ".bias"], *ident)
    return m


def config_from_hf(vc: dict, where: str) -> SiglipConfig:
    """A SiglipConfig from config.json's vision_config (SiglipVisionConfig's defaults for what it leaves out);
    options posttrain does not implement are a PosttrainError naming `where` and the key."""
    from posttrain.errors import PosttrainError

    act = vc.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise PosttrainError(f"{where}: vision_config.hidden_act {act!r} is not supported (gelu_pytorch_tanh is)")
    if vc.get("vision_use_head", True):  # SiglipVisionModel: a head unless the config says vision_use_head false
        raise PosttrainError(f"{where}: vision_config.vision_use_head must be false (the pooling head is not "
                             "supported; Gemma 3 has none)")
    if vc.get("attention_dropout", 0.0):
        raise PosttrainError(f"{where}: vision_config.attention_dropout must be 0")
    return SiglipConfig(hidden_size=vc.get("hidden_size", 768), intermediate_size=vc.get("intermediate_size", 3072),
                        num_layers=vc.get("num_hidden_layers", 12), num_heads=vc.get("num_attention_heads", 12),
                        image_size=vc.get("image_size", 224), patch_size=vc.get("patch_size", 16),
                        num_channels=vc.get("num_channels", 3), eps=float(vc.get("layer_norm_eps", 1e-6)))


def config_to_hf(cfg: SiglipConfig) -> dict:
    """config.json's vision_config for a SiglipConfig."""
    return dict(model_type="siglip_vision_model", hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, image_size=cfg.image_size, patch_size=cfg.patch_size,
                num_channels=cfg.num_channels, layer_norm_eps=cfg.eps, hidden_act="gelu_pytorch_tanh",
                attention_dropout=0.0, vision_use_head=False)

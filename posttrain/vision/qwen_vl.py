"""Qwen3-VL's vision tower in JAX / Flax NNX (transformers 5.12 `Qwen3VLVisionModel`), and the glue that runs a
vision-language forward through the one Transformer (`image_forward`).

The tower, per transformers' `models/qwen3_vl/modeling_qwen3_vl.py`:
  - patch embedding: a Conv3d of kernel = stride = (temporal_patch_size, P, P) over the processor's flattened
    [C, T, P, P] patches, i.e. one matmul [N, C*T*P*P] x [C*T*P*P, D] plus a bias;
  - a learned [side^2, D] position table bilinearly interpolated to each image's (h, w) patch grid
    (`fast_pos_embed_interpolate` / vision_utils.get_vision_bilinear_indices_and_weights), in merge-block order;
  - 2-D RoPE: each head's first half rotates by the patch's row, its second half by its column (H/4 frequencies
    each, rotate-half over the whole head);
  - pre-LayerNorm blocks: full (non-causal) attention within each frame of each image (cu_seqlens), a
    gelu-tanh MLP;
  - the patch merger: LayerNorm per patch, each 2x2 merge block (4 consecutive patches) concatenated, Linear, exact
    GELU, Linear to the text width; DeepStack mergers do the same from the listed blocks' outputs, normalising
    after the concatenation.
Host-side grid tables (`grid_tables`) are NumPy: an image's grid is static, so they are constants of the program.

Into the text model (transformers' Qwen3VLModel.forward): the image features replace the embeddings of the image
tokens (in order); the DeepStack features are added to the outputs of the first len(deepstack_visual_indexes)
decoder layers at the image tokens; positions are 3-D M-RoPE positions (`rope_index`, transformers'
get_rope_index). What it is not: video (frames with timestamps), the processor's chat template, or the sampler's
image prefill (generate/vision.py; a decode step continues at its text position + `rope_index`'s delta on all
three axes).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.errors import PosttrainError
from posttrain.sharding import param


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """transformers' Qwen3VLVisionConfig (defaults: Qwen/Qwen3-VL-4B-Instruct's) plus the outer config's token ids."""

    depth: int = 27  # vision blocks
    hidden_size: int = 1152  # D of the tower
    intermediate_size: int = 4304  # MLP width
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16  # P (pixels)
    temporal_patch_size: int = 2  # frames a patch spans (an image is repeated to fill them)
    spatial_merge_size: int = 2  # merge blocks of m x m patches make one text token
    out_hidden_size: int = 3584  # the text model's embed_dim
    num_position_embeddings: int = 2304  # learned position table: a side x side grid
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)  # blocks whose outputs feed DeepStack
    hidden_act: str = "gelu_pytorch_tanh"  # the blocks' MLP activation
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


# ----------------------------------------------------------------------------- host-side grid tables


def _linspace32(end: float, n: int) -> np.ndarray:
    """torch.linspace(0, end, n) in float32, as torch computes it (from both ends, meeting in the middle)."""
    if n == 1:
        return np.zeros(1, np.float32)
    step = np.float32(end) / np.float32(n - 1)
    i = np.arange(n)
    lo = i.astype(np.float32) * step
    hi = np.float32(end) - (n - 1 - i).astype(np.float32) * step
    return np.where(i < n // 2, lo, hi).astype(np.float32)


def grid_tables(grid_thw, cfg: VisionConfig) -> dict:
    """For images of (t, h, w) patch grids, in the processor's patch order (merge blocks outermost):
    `corners` [4, N] int indices into the position table and `weights` [4, N] float32 (bilinear interpolation),
    `rows` / `cols` [N] the patch's row and column (2-D RoPE), `lengths` the attention blocks (one per frame)."""
    side, m = int(cfg.num_position_embeddings ** 0.5), cfg.spatial_merge_size
    corners, weights, rows, cols, lengths = [], [], [], [], []
    for t, h, w in np.asarray(grid_thw, np.int64).reshape(-1, 3).tolist():
        hg, wg = _linspace32(side - 1, h), _linspace32(side - 1, w)
        hf, wf = hg.astype(np.int64), wg.astype(np.int64)
        hc, wc = np.minimum(hf + 1, side - 1), np.minimum(wf + 1, side - 1)
        dh, dw = (hg - hf).astype(np.float32), (wg - wf).astype(np.float32)
        idx = [hf[:, None] * side + wf[None], hf[:, None] * side + wc[None], hc[:, None] * side + wf[None],
               hc[:, None] * side + wc[None]]
        one = np.float32(1)
        wts = [(one - dh)[:, None] * (one - dw)[None], (one - dh)[:, None] * dw[None], dh[:, None] * (one - dw)[None],
               dh[:, None] * dw[None]]
        # row-major (h, w) -> merge-block order (h/m, w/m, m, m), repeated per frame
        hi = np.arange(h).reshape(h // m, m)
        wi = np.arange(w).reshape(w // m, m)
        order = (hi[:, None, :, None] * w + wi[None, :, None, :]).reshape(-1)
        corners.append(np.stack([c.reshape(-1)[order] for c in idx])[:, np.tile(np.arange(h * w), t)])
        weights.append(np.stack([c.reshape(-1)[order] for c in wts])[:, np.tile(np.arange(h * w), t)])
        rows.append(np.tile(order // w, t))
        cols.append(np.tile(order % w, t))
        lengths += [h * w] * t
    return dict(corners=np.concatenate(corners, 1), weights=np.concatenate(weights, 1).astype(np.float32),
                rows=np.concatenate(rows), cols=np.concatenate(cols), lengths=tuple(lengths))


# ----------------------------------------------------------------------------- the tower


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm (eps 1e-6, with bias), in float32."""

    def __init__(self, dim: int, pd, eps: float = 1e-6):
        self.scale = param(jnp.ones((dim,), pd), (None,))
        self.bias = param(jnp.zeros((dim,), pd), (None,))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        mu = xf.mean(-1, keepdims=True)
        var = ((xf - mu) ** 2).mean(-1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Dense(nnx.Module):
    """x @ w + b (w stored [in, out]; HF's Linear weight transposed)."""

    def __init__(self, n_in: int, n_out: int, pd, rngs: nnx.Rngs):
        self.w = param(nnx.initializers.normal(0.02)(rngs.params(), (n_in, n_out), pd), (None, None))
        self.b = param(jnp.zeros((n_out,), pd), (None,))

    def __call__(self, x):
        return x @ self.w[...].astype(x.dtype) + self.b[...].astype(x.dtype)


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, pd, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.norm1, self.norm2 = LayerNorm(D, pd), LayerNorm(D, pd)
        self.attn_in = Dense(D, 3 * D, pd, rngs)  # HF attn.qkv: [q | k | v], heads within each
        self.attn_out = Dense(D, D, pd, rngs)  # HF attn.proj
        self.fc1, self.fc2 = Dense(D, cfg.intermediate_size, pd, rngs), Dense(cfg.intermediate_size, D, pd, rngs)
        self.heads = cfg.num_heads
        self.act = cfg.hidden_act

    def __call__(self, x, cos, sin, lengths):
        N, D = x.shape
        qkv = self.attn_in(self.norm1(x)).reshape(N, 3, self.heads, D // self.heads)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = _rope2d(q, cos, sin), _rope2d(k, cos, sin)
        outs, start = [], 0
        for n in lengths:  # full attention within each frame of each image (the grid is static)
            s = slice(start, start + n)
            scores = jnp.einsum("qnh,knh->nqk", q[s], k[s]) * (D // self.heads) ** -0.5
            p = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
            outs.append(jnp.einsum("nqk,knh->qnh", p, v[s]))
            start += n
        x = x + self.attn_out(jnp.concatenate(outs).reshape(N, D))
        h = self.fc1(self.norm2(x))
        h = jax.nn.gelu(h, approximate=True) if self.act in ("gelu_pytorch_tanh", "gelu_tanh") else (
            jax.nn.gelu(h, approximate=False) if self.act == "gelu" else jax.nn.silu(h))
        return x + self.fc2(h)


def _rope2d(x, cos, sin):
    """Rotate-half RoPE in float32 (transformers' apply_rotary_pos_emb_vision). x [N, heads, H]; cos, sin [N, H]."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None] + rot * sin[:, None]).astype(x.dtype)


class Merger(nnx.Module):
    """Qwen3VLVisionPatchMerger: m x m patches -> one text-width vector. postshuffle: the norm over the
    concatenation (DeepStack's mergers), else per patch (the final merger)."""

    def __init__(self, cfg: VisionConfig, pd, rngs: nnx.Rngs, postshuffle: bool):
        wide = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = LayerNorm(wide if postshuffle else cfg.hidden_size, pd)
        self.fc1, self.fc2 = Dense(wide, wide, pd, rngs), Dense(wide, cfg.out_hidden_size, pd, rngs)
        self.wide = wide

    def __call__(self, x):
        x = self.norm(x.reshape(-1, self.wide)) if self.postshuffle else self.norm(x).reshape(-1, self.wide)
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class VisionTower(nnx.Module):
    """pixels [N, C*T*P*P] (posttrain.vision.qwen_vl_patches) and their grids -> (image features [N / m^2,
    out_hidden_size], DeepStack features: one such array per `deepstack_visual_indexes`)."""

    def __init__(self, cfg: VisionConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        pd = jnp.dtype(param_dtype)
        D = cfg.hidden_size
        self.cfg = cfg
        self.patch_embed = Dense(cfg.patch_dim, D, pd, rngs)
        self.pos_embed = param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.num_position_embeddings, D), pd),
                               (None, None))
        self.blocks = nnx.List([VisionBlock(cfg, pd, rngs) for _ in range(cfg.depth)])
        self.merger = Merger(cfg, pd, rngs, postshuffle=False)
        self.deepstack = nnx.List([Merger(cfg, pd, rngs, postshuffle=True) for _ in cfg.deepstack_visual_indexes])

    def __call__(self, pixels, grid_thw, dtype=jnp.float32):
        cfg = self.cfg
        g = grid_tables(grid_thw, cfg)
        x = self.patch_embed(pixels.astype(dtype))
        table = self.pos_embed[...].astype(jnp.float32)
        pos = (jnp.take(table, g["corners"], axis=0) * g["weights"][:, :, None]).sum(0)
        x = x + pos.astype(dtype)
        hd = cfg.hidden_size // cfg.num_heads
        inv = 1.0 / (10_000.0 ** (np.arange(0, hd // 2, 2, dtype=np.float32) / np.float32(hd // 2)))
        freqs = np.concatenate([g["rows"][:, None] * inv, g["cols"][:, None] * inv], axis=1).astype(np.float32)
        emb = np.concatenate([freqs, freqs], axis=1)
        cos, sin = jnp.cos(jnp.asarray(emb)), jnp.sin(jnp.asarray(emb))
        deep = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, g["lengths"])
            if i in cfg.deepstack_visual_indexes:
                deep.append(self.deepstack[cfg.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), tuple(deep)


# ----------------------------------------------------------------------------- into the text model


def rope_index(tokens, mask, grid_thw, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """transformers' Qwen3-VL get_rope_index for images (NumPy): (positions [3, B, T] int32, delta [B] int32).
    Text tokens count on from the last position on every axis; an image's tokens take (start, start + row,
    start + col) and the text after it starts at start + max(h, w) / m. Padding (mask 0) gets position 0 on every
    axis, as in transformers; a decode step's positions are its text position + delta. Images are taken in order
    across the batch, t * h * w / m^2 tokens each (transformers would read two images with no token between them as
    one; Qwen's processor always puts vision start / end tokens around each)."""
    tokens, mask = np.asarray(tokens), np.asarray(mask).astype(bool)
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    m = cfg.spatial_merge_size
    want, have = int((grid.prod(1) // m ** 2).sum()), int(((tokens == cfg.image_token_id) & mask).sum())
    if want != have:
        raise PosttrainError(f"the rows hold {have} image tokens (id {cfg.image_token_id}) but the {len(grid)} image "
                             f"grids make {want}; give each image qwen_vl_image_tokens(grid) tokens, in order")
    grids = iter(grid.tolist())
    B, T = tokens.shape
    pos = np.zeros((3, B, T), np.int64)
    delta = np.zeros(B, np.int64)
    for b in range(B):
        ids = tokens[b][mask[b]]
        image = ids == cfg.image_token_id
        out, cur, i = [], 0, 0
        while i < len(ids):
            j = i
            while j < len(ids) and image[j] == image[i]:
                j += 1
            if not image[i]:
                out.append(np.broadcast_to(np.arange(j - i) + cur, (3, j - i)))
                cur += j - i
            else:
                t, h, w = next(grids)
                lt, lh, lw = t, h // m, w // m
                tt = np.repeat(np.arange(lt), lh * lw) + cur
                hh = np.tile(np.repeat(np.arange(lh), lw), lt) + cur
                ww = np.tile(np.arange(lw), lh * lt) + cur
                out.append(np.stack([tt, hh, ww]))
                cur += max(h, w) // m
                j = i + lt * lh * lw  # one image's tokens (two images back to back are two runs)
            i = j
        p = np.concatenate(out, axis=1) if out else np.zeros((3, 0), np.int64)
        pos[:, b, mask[b]] = p
        delta[b] = (p.max() + 1 - len(ids)) if p.size else 0
    return pos.astype(np.int32), delta.astype(np.int32)


def place(mask, features, dtype):
    """Rows of `features` [n, D] scattered to the True slots of mask [B, T] in order: [B, T, D], zero elsewhere."""
    flat = mask.reshape(-1)
    idx = jnp.clip(jnp.cumsum(flat) - 1, 0, max(features.shape[0] - 1, 0))
    out = jnp.take(features.astype(dtype), idx, axis=0) * flat[:, None].astype(dtype)
    return out.reshape(*mask.shape, features.shape[-1])


def image_embeds(model, tokens, features, deepstack=()) -> dict:
    """The Transformer's vision keywords for `tokens` [B, T]: `embeds` (the token embeddings with the image tokens'
    replaced by `features` [n, D], in order) and `deepstack` (each [n, D] array placed at the image tokens)."""
    dt = jnp.dtype(model.cfg.dtype)
    mask = tokens == model.cfg.vision.image_token_id
    x = jnp.where(mask[..., None], place(mask, features, dt), model.embed_tokens(tokens))
    return {"embeds": x, "deepstack": tuple(place(mask, d, dt) for d in deepstack)}


def image_forward(model, tokens, positions, pixels=None, grid_thw=None, *, segment_ids=None, **kw):
    """A Qwen3-VL forward: the tower on `pixels` / `grid_thw` (None: text only), its features in place of the image
    tokens' embeddings and added after the first decoder layers (DeepStack), then `model(tokens, positions, ...)`
    with positions [3, B, T] from `rope_index` (or [B, T] for text only). Returns the Transformer's ModelOutput."""
    if pixels is None:
        return model(tokens, positions, segment_ids=segment_ids, **kw)
    feats, deep = model.vision(pixels, grid_thw, dtype=jnp.dtype(model.cfg.dtype))
    return model(tokens, positions, segment_ids=segment_ids, **image_embeds(model, tokens, feats, deep), **kw)


def vision_names(vcfg: VisionConfig, prefix: str = "model.visual.") -> dict:
    """The tower's weight map (posttrain path -> (HF keys, load, save)), as hf_names.weight_map's entries."""
    ident, tr = (lambda a: a, lambda a: [a]), (lambda w: w.T, lambda w: [w.T])
    D, K = vcfg.hidden_size, vcfg.patch_dim
    V = ("vision",)
    m = {V + ("patch_embed", "w"): ([prefix + "patch_embed.proj.weight"], lambda w: w.reshape(D, K).T,
                                    lambda w: [w.T.reshape(D, vcfg.in_channels, vcfg.temporal_patch_size,
                                                           vcfg.patch_size, vcfg.patch_size)]),
         V + ("patch_embed", "b"): ([prefix + "patch_embed.proj.bias"], *ident),
         V + ("pos_embed",): ([prefix + "pos_embed.weight"], *ident)}

    def dense(path, name):
        m[V + path + ("w",)] = ([prefix + name + ".weight"], *tr)
        m[V + path + ("b",)] = ([prefix + name + ".bias"], *ident)

    def norm(path, name):
        m[V + path + ("scale",)] = ([prefix + name + ".weight"], *ident)
        m[V + path + ("bias",)] = ([prefix + name + ".bias"], *ident)

    for i in range(vcfg.depth):
        b, p = ("blocks", i), f"blocks.{i}."
        norm(b + ("norm1",), p + "norm1")
        norm(b + ("norm2",), p + "norm2")
        dense(b + ("attn_in",), p + "attn.qkv")
        dense(b + ("attn_out",), p + "attn.proj")
        dense(b + ("fc1",), p + "mlp.linear_fc1")
        dense(b + ("fc2",), p + "mlp.linear_fc2")
    for path, name in [(("merger",), "merger")] + [(("deepstack", j), f"deepstack_merger_list.{j}")
                                                   for j in range(len(vcfg.deepstack_visual_indexes))]:
        norm(path + ("norm",), name + ".norm")
        dense(path + ("fc1",), name + ".linear_fc1")
        dense(path + ("fc2",), name + ".linear_fc2")
    return m


def vision_config(d: dict, outer: Optional[dict] = None) -> VisionConfig:
    """A VisionConfig from config.json's vision_config (and the outer config's token ids)."""
    names = {f.name for f in dataclasses.fields(VisionConfig)}
    kw = {k: v for k, v in {**(d or {}), **{k: v for k, v in (outer or {}).items() if k.endswith("_token_id")}}.items()
          if k in names}
    if "deepstack_visual_indexes" in kw:
        kw["deepstack_visual_indexes"] = tuple(kw["deepstack_visual_indexes"])
    return VisionConfig(**kw)

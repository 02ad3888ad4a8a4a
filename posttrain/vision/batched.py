"""Qwen3-VL image rows in training batches: static shapes, one row at a time through the tower.

What it is: `row_tables(grids, cfg, patches)` lays one row's images out as host arrays padded to a fixed number of
patches (the pipeline's bucket), and `forward_rows(model, batch, **kw)` runs a batch of such rows through the
tower and the text model. A row carries
  pixels         float32 [P, C*T*P*P]  its images' patches (posttrain.vision.qwen_vl_patches), zero after them
  patch_corners  int32   [4, P]        position-table indices of the bilinear interpolation (`grid_tables`)
  patch_weights  float32 [4, P]        their weights (0 on padding)
  patch_rows / patch_cols  int32 [P]  each patch's row and column (2-D RoPE)
  patch_blocks   int32   [P]           1, 2, ... one per image frame; 0 on padding. A patch attends the patches of
                                       its own block (transformers' cu_seqlens), as a mask instead of slices
  positions      int32   [3, T]        M-RoPE positions of the row (`rope_index`); [B, 3, T] in a batch
so a batch's shapes never depend on the images' sizes (no recompiles), and rows split over devices and
micro-batches like any other field. Each row's image features go to its own image tokens, in order.

The arithmetic equals `VisionTower.__call__` (the same modules' weights; attention masked instead of sliced, which
adds exact zeros), checked against transformers' loss in tests/test_vlm_data.py. A packed row (`data.packing`) holds
several examples' images one after another (`data.images.group_image_fields`: each segment's M-RoPE positions from
its own rope_index); the tower's blocks and the segment ids keep the examples apart (tests/test_vlm_packing.py).
Gemma 3 rows (`gemma3_forward_rows`, which `forward_rows` picks for a Gemma3VL) carry their images as whole pixel
arrays [I, 3, S, S] instead of the patch tables. What it is not: video, or the sampler's prefill
(`qwen_vl.image_forward`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models.layers import computed_once
from posttrain.vision.qwen_vl import VisionConfig, grid_tables

TABLE_FIELDS = ("pixels", "patch_corners", "patch_weights", "patch_rows", "patch_cols", "patch_blocks")


def row_tables(pixels: np.ndarray, grids: np.ndarray, cfg: VisionConfig, patches: int) -> dict[str, np.ndarray]:
    """One row's TABLE_FIELDS, padded to `patches` patches (a multiple of spatial_merge_size^2)."""
    n = int(pixels.shape[0])
    out = {"pixels": np.zeros((patches, cfg.patch_dim), np.float32),
           "patch_corners": np.zeros((4, patches), np.int32), "patch_weights": np.zeros((4, patches), np.float32),
           "patch_rows": np.zeros(patches, np.int32), "patch_cols": np.zeros(patches, np.int32),
           "patch_blocks": np.zeros(patches, np.int32)}
    if n == 0:
        return out
    g = grid_tables(grids, cfg)
    out["pixels"][:n] = pixels
    out["patch_corners"][:, :n] = g["corners"]
    out["patch_weights"][:, :n] = g["weights"]
    out["patch_rows"][:n], out["patch_cols"][:n] = g["rows"], g["cols"]
    out["patch_blocks"][:n] = np.repeat(np.arange(1, len(g["lengths"]) + 1), g["lengths"])
    return out


def _rope2d_tables(rows_cols, hd: int):
    """(cos, sin) [B, P, hd] of the 2-D RoPE from each patch's (row, column) [2, B, P] (transformers'
    VisionRotaryEmbedding over rows then columns)."""
    inv = jnp.asarray(1.0 / (10_000.0 ** (np.arange(0, hd // 2, 2, dtype=np.float32) / np.float32(hd // 2))))
    freqs = jnp.concatenate([rows_cols[0][..., None] * inv, rows_cols[1][..., None] * inv], axis=-1)
    emb = jnp.concatenate([freqs, freqs], axis=-1).astype(jnp.float32)
    return jnp.cos(emb), jnp.sin(emb)


def _rope2d(x, cos, sin):
    """transformers' apply_rotary_pos_emb_vision over rows: x [B, P, heads, H]; cos, sin [B, P, H]."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None] + rot * sin[:, :, None]).astype(x.dtype)


def _block(blk, x, cos, sin, same):
    """A VisionBlock over [B, P, D] rows; `same` [B, P, P]: whether two patches are in one image frame."""
    B, P, D = x.shape
    hd = D // blk.heads
    qkv = blk.attn_in(blk.norm1(x)).reshape(B, P, 3, blk.heads, hd)
    q, k, v = _rope2d(qkv[:, :, 0], cos, sin), _rope2d(qkv[:, :, 1], cos, sin), qkv[:, :, 2]
    scores = jnp.einsum("bqnh,bknh->bnqk", q, k).astype(jnp.float32) * hd ** -0.5
    scores = jnp.where(same[:, None], scores, -jnp.inf)  # each query sees at least itself: no empty row
    p = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    x = x + blk.attn_out(jnp.einsum("bnqk,bknh->bqnh", p, v).reshape(B, P, D))
    h = blk.fc1(blk.norm2(x))
    h = jax.nn.gelu(h, approximate=True) if blk.act in ("gelu_pytorch_tanh", "gelu_tanh") else (
        jax.nn.gelu(h, approximate=False) if blk.act == "gelu" else jax.nn.silu(h))
    return x + blk.fc2(h)


def tower_rows(tower, batch, dtype=jnp.float32):
    """The tower over a batch's rows: (features [B, P / m^2, out], DeepStack features: tuple of the same shape)."""
    cfg = tower.cfg
    pixels = batch["pixels"]
    B, P, _ = pixels.shape
    x = tower.patch_embed(pixels.astype(dtype))
    table = tower.pos_embed[...].astype(jnp.float32)
    pos = (jnp.take(table, batch["patch_corners"], axis=0) * batch["patch_weights"][..., None]).sum(1)
    x = x + pos.astype(dtype)
    cos, sin = computed_once(functools.partial(_rope2d_tables, hd=cfg.hidden_size // cfg.num_heads),
                             jnp.stack([batch["patch_rows"], batch["patch_cols"]]))
    blocks = batch["patch_blocks"]
    same = blocks[:, :, None] == blocks[:, None, :]
    deep, tokens = [], P // cfg.spatial_merge_size ** 2  # a merger's [B * tokens, out] back to rows
    for i, blk in enumerate(tower.blocks):
        x = _block(blk, x, cos, sin, same)
        if i in cfg.deepstack_visual_indexes:
            deep.append(tower.deepstack[cfg.deepstack_visual_indexes.index(i)](x).reshape(B, tokens, -1))
    return tower.merger(x).reshape(B, tokens, -1), tuple(deep)


def place_rows(mask, features, dtype):
    """Each row's features [B, n, D] at its True slots of mask [B, T], in order: [B, T, D], zero elsewhere."""
    idx = jnp.clip(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0, features.shape[1] - 1)
    out = jnp.take_along_axis(features.astype(dtype), idx[..., None], axis=1)
    return out * mask[..., None].astype(dtype)


def forward_rows(model, batch, **kw):
    """The model's forward on a batch of image rows (fields above plus tokens / segment_ids): the tower's features in
    place of the image tokens' embeddings, DeepStack added after the first layers, M-RoPE positions. A batch without
    `pixels` (text rows on a vision-language model) is the plain text forward. With `branch_ids` (prefix-shared rows,
`rl/images.py`) the branches attend the prompt and themselves only, and only the prompt's image tokens take
features."""
    if "pixels" not in batch:
        return model(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"],
                     branch_ids=batch.get("branch_ids"), **kw)
    if hasattr(model, "vcfg"):  # a Gemma3VL
        return gemma3_forward_rows(model, batch, **kw)
    cfg = model.cfg
    dt = jnp.dtype(cfg.dtype)
    feats, deep = tower_rows(model.vision, batch, dt)
    tokens = batch["tokens"]
    mask = tokens == cfg.vision.image_token_id
    if "branch_ids" in batch:  # prefix-shared rows (GRPO): the images are the prompt's; a sampled image id is text
        mask = mask & (batch["branch_ids"] == 0)
    x = jnp.where(mask[..., None], place_rows(mask, feats, dt), model.embed_tokens(tokens))
    positions = jnp.moveaxis(batch["positions"], 1, 0)  # [B, 3, T] -> [3, B, T]
    return model(tokens, positions, segment_ids=batch["segment_ids"], branch_ids=batch.get("branch_ids"), embeds=x,
                 deepstack=tuple(place_rows(mask, d, dt) for d in deep), **kw)


def gemma3_forward_rows(model, batch, **kw):
    """A Gemma3VL's forward on a batch of image rows: `pixels` [B, I, 3, S, S] (each row's images in order, zero
    after them: `data.images.group_image_fields`), 1-D positions and segment ids. Each row's projected image
    features go to its own image tokens in order (a padding image's features go nowhere), each run of image tokens
    attends itself both ways (`gemma3.image_blocks`; segment ids keep packed examples apart), as
    `Gemma3VL.__call__` does for one batch of images."""
    from posttrain.vision.gemma3 import image_blocks

    vc, tokens, pixels = model.vcfg, batch["tokens"], batch["pixels"]
    B, n = pixels.shape[:2]
    feats = model.image_features(pixels.reshape(B * n, *pixels.shape[2:])).reshape(B, n * vc.mm_tokens_per_image, -1)
    x, _ = model.embeds(tokens)  # the text's scaled embeddings (an image id past the vocabulary as token 0)
    mask = tokens == vc.image_token_id
    if "branch_ids" in batch:
        mask = mask & (batch["branch_ids"] == 0)
    x = jnp.where(mask[..., None], place_rows(mask, feats, x.dtype), x)
    return model(tokens, batch["positions"], segment_ids=batch["segment_ids"], branch_ids=batch.get("branch_ids"),
                 embeds=x, image_ids=image_blocks(jnp.where(mask, tokens, -1), vc.image_token_id), **kw)

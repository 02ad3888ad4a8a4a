"""Gemma 3 vision-language (transformers 5.12's `Gemma3ForConditionalGeneration`, config.json model_type `gemma3`):
the SigLIP tower (`vision/siglip.py`), the multimodal projector, and the one Transformer as its language model.

Per transformers' `modeling_gemma3.py`:
  - projector (`Gemma3MultiModalProjector`): the tower's [N, p * p, Dv] patch states as a p x p grid, averaged
    over k x k windows (k = p / sqrt(mm_tokens_per_image)) to mm_tokens_per_image tokens (row-major), an RMSNorm
    that scales by (1 + w) with the tower's eps, then [Dv, D] (`mm_input_projection_weight`);
  - merging (`Gemma3Model.forward`): the text's scaled token embeddings, with the i-th image token of the batch
    (row-major) replaced by the i-th projected image token (`masked_scatter`); an image token id outside the
    vocabulary embeds as token 0 first;
  - masking: every run of image tokens (one image) attends itself in both directions (`token_type_ids`,
    `blockwise_overlay`), added to the causal (and sliding-window) rule: `image_blocks` gives the Transformer's
    `image_ids`, which `models/attention.py` reads.
The processor puts `\\n\\n<start_of_image>` + mm_tokens_per_image image tokens + `<end_of_image>\\n\\n` in the text
for each image: one run per image, so runs and images agree.

What it is not: the tokenizer / chat-template side (where image tokens go), pan-and-scan crops bookkeeping, the
data path or recipes for images (docs/models.md, "Vision-language: Gemma 3").
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig
from posttrain.models.layers import RMSNorm
from posttrain.models.transformer import ModelOutput, Transformer
from posttrain.sharding import param
from posttrain.vision.siglip import SiglipConfig, SiglipVision


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3VisionConfig:
    """The multimodal folder's own fields (Gemma3Config), beside the text model's ModelConfig."""

    vision: SiglipConfig
    mm_tokens_per_image: int = 256  # image tokens each image becomes
    image_token_id: int = 262_144  # image_token_index
    boi_token_id: int = 255_999  # boi_token_index (<start_of_image>), only written back
    eoi_token_id: int = 256_000  # eoi_token_index (<end_of_image>), only written back

    def __post_init__(self):
        side = int(round(self.mm_tokens_per_image ** 0.5))
        p = self.vision.patches_per_side
        if side * side != self.mm_tokens_per_image or p % side:
            raise PosttrainError(f"mm_tokens_per_image {self.mm_tokens_per_image} must be a square whose side "
                                 f"divides the {p} patches a side of the vision tower")


class Gemma3Projector(nnx.Module):
    """[N, p * p, Dv] tower states -> [N, mm_tokens_per_image, D] (Gemma3MultiModalProjector)."""

    def __init__(self, vcfg: Gemma3VisionConfig, embed_dim: int, *, rngs: nnx.Rngs):
        v = vcfg.vision
        pd = jnp.dtype(v.param_dtype)
        self.patches = v.patches_per_side
        self.side = int(round(vcfg.mm_tokens_per_image ** 0.5))
        self.norm = RMSNorm(v.hidden_size, eps=v.eps, unit_offset=True, param_dtype=pd, names=(None,))
        self.proj = param(nnx.initializers.normal(0.02)(rngs.params(), (v.hidden_size, embed_dim), pd),
                          (None, "embed"))

    def __call__(self, x):
        N, _, Dv = x.shape
        p, t = self.patches, self.side
        k = p // t
        x = x.reshape(N, t, k, t, k, Dv).mean(axis=(2, 4)).reshape(N, t * t, Dv)  # AvgPool2d(k, stride k)
        return self.norm(x) @ self.proj[...].astype(x.dtype)


def image_blocks(tokens, image_token_id: int):
    """[B, T] int32: 0 for text, b > 0 for the b-th run of image tokens in the row (transformers'
    get_block_sequence_ids_for_mask, plus one)."""
    img = tokens == image_token_id
    prev = jnp.pad(img, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(img, jnp.cumsum(img & ~prev, axis=1, dtype=jnp.int32), 0)


def merge_images(x, tokens, features, image_token_id: int):
    """x [B, T, D] with the image tokens' rows replaced, in row-major order, by features [M, D] (masked_scatter)."""
    img = (tokens == image_token_id).reshape(-1)
    index = jnp.clip(jnp.cumsum(img, dtype=jnp.int32) - 1, 0, features.shape[0] - 1)
    flat = jnp.where(img[:, None], jnp.take(features.astype(x.dtype), index, axis=0), x.reshape(-1, x.shape[-1]))
    return flat.reshape(x.shape)


def check_image_tokens(tokens, n_images: int, per_image: int, image_token_id: int) -> None:
    """Raise a PosttrainError unless the batch holds exactly n_images * per_image image tokens (concrete only)."""
    if isinstance(tokens, jax.core.Tracer):
        return
    n = int(np.sum(np.asarray(tokens) == image_token_id))
    if n != n_images * per_image:
        raise PosttrainError(f"the tokens hold {n} image tokens (id {image_token_id}) but {n_images} images give "
                             f"{n_images * per_image} ({per_image} each); put one run of {per_image} image tokens in "
                             "the text for each image, as Gemma3Processor does")


class Gemma3VL(nnx.Module):
    """Gemma 3 vision-language: `text` (the one Transformer), `vision` (SigLIP), `projector`.

    `model(tokens, positions, pixels=None, **kw)` is `text(...)` with the images merged in: pixels [N, 3, S, S]
    (`vision.preprocess.gemma3_pixels`), one per run of image tokens, in row-major order over the batch. Every
    other keyword (segment_ids, cache, return_hidden, ...) is the Transformer's. Without pixels it is the text
    model (image tokens embed as tokens). `cfg` is the text model's ModelConfig (setting it sets the text model's:
    the recipes' remat / precision settings)."""

    TOWER = ("vision", "projector")  # what makes the image features: frozen in training unless model.train_vision

    def __init__(self, cfg: ModelConfig, vcfg: Gemma3VisionConfig, *, rngs: nnx.Rngs):
        self.vcfg = vcfg
        self.text = Transformer(cfg, rngs=rngs)
        self.vision = SiglipVision(vcfg.vision, rngs=rngs)
        self.projector = Gemma3Projector(vcfg, cfg.embed_dim, rngs=rngs)

    @property
    def cfg(self) -> ModelConfig:
        return self.text.cfg

    @cfg.setter
    def cfg(self, value: ModelConfig) -> None:
        self.text.cfg = value

    # the text model's parts the sampler reads (generate.Sampler runs a Gemma3VL as a Transformer)
    lm_head = property(lambda self: self.text.lm_head)
    embed = property(lambda self: self.text.embed)

    def unembed(self, h, head=None):
        return self.text.unembed(h, head)

    def rope_tables(self, length: int) -> dict:
        return self.text.rope_tables(length)

    def image_features(self, pixels):
        """pixels [N, 3, S, S] -> [N, mm_tokens_per_image, D] (Gemma3Model.get_image_features)."""
        return self.projector(self.vision(pixels))

    def embeds(self, tokens, pixels=None):
        """(input embeddings [B, T, D], image block ids [B, T] or None) of tokens with their images merged."""
        vc = self.vcfg
        safe = jnp.where(tokens >= self.cfg.vocab_size, 0, tokens) if vc.image_token_id >= self.cfg.vocab_size \
            else tokens
        x = self.text.embed_tokens(safe)
        if pixels is None:
            return x, None
        check_image_tokens(tokens, pixels.shape[0], vc.mm_tokens_per_image, vc.image_token_id)
        feats = self.image_features(pixels).reshape(-1, self.cfg.embed_dim)
        return merge_images(x, tokens, feats, vc.image_token_id), image_blocks(tokens, vc.image_token_id)

    def __call__(self, tokens, positions, pixels=None, *, embeds: Optional[jax.Array] = None,
                 image_ids: Optional[jax.Array] = None, **kw) -> ModelOutput:
        if embeds is None and pixels is not None:
            embeds, image_ids = self.embeds(tokens, pixels)
        return self.text(tokens, positions, embeds=embeds, image_ids=image_ids, **kw)

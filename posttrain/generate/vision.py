"""Images through the Sampler's prefill (issue #52): `ImageInputs` (one prompt's images) and `ImagePrefill`, the
stage that turns a batch's images into the prefill's positions and forward keywords.

What it is: for a vision-language model, before the Sampler's one prefill. Qwen3-VL (`model.cfg.vision`, the tower
inside the Transformer, vision/qwen_vl.py): the M-RoPE positions [3, B, P] of the left-padded prompt bucket
(`rope_index`), each row's decode delta (a decode step runs at its text position + delta on all three axes), and the
Transformer's keywords (`embeds`: the image features in place of the image tokens' embeddings; `deepstack`). The
tower runs in its own jitted function (its shapes follow the image grids, which are static), so the text prefill
compiles once per prompt bucket whatever the images; the decode loop is the text one. Group sampling shares the
image prefill as it shares a text one (the cache, the logits and the next positions are repeated n times after it).
Gemma 3 (vision/gemma3.py's Gemma3VL, `model.vcfg`): the plain positions, delta 0, and the keywords `embeds` (the
projected image tokens merged into the token embeddings) and `image_ids` (each image's run attends itself both ways),
computed in their own jitted function (one per number of images).
What it is not: the tokenizer side (where the image tokens go: `expand_image_tokens`, the CLI), multi-turn
(`Sampler.begin` / `extend`) with images, or a second decode loop.

Another family plugs in by a branch of `ImagePrefill.__call__` that returns (positions, delta, keywords).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.errors import PosttrainError
from posttrain.sharding import use_mesh
from posttrain.vision.qwen_vl import VisionConfig, image_embeds, rope_index


@dataclasses.dataclass
class ImageInputs:
    """One prompt's images, for its image tokens in order: the processor's output (Qwen-VL: `qwen_vl_patches`'
    patches and grids; Gemma 3: `gemma3_pixels`' images, no grids), or Qwen-VL's tower output computed elsewhere
    (`features` and `deepstack`, with the grids, which fix the M-RoPE positions)."""

    grids: Optional[np.ndarray] = None  # Qwen-VL: [images, 3] int (t, h, w) patch grid of each image
    # Qwen-VL: [patches, patch_dim] float32, the images' flattened patches; Gemma 3: [images, 3, S, S]
    pixels: Optional[np.ndarray] = None
    features: Optional[np.ndarray] = None  # [image tokens, D]: the tower's merged features (instead of pixels)
    deepstack: tuple = ()  # with features: the DeepStack features, [image tokens, D] each

    def __post_init__(self):
        if self.grids is not None:
            self.grids = np.asarray(self.grids, np.int64).reshape(-1, 3)
        if (self.pixels is None) == (self.features is None):
            raise PosttrainError("ImageInputs: give exactly one of pixels (the processor's patches) or features "
                                 "(the vision tower's output)")


def expand_image_tokens(ids: Sequence[int], image_id: int, counts: Sequence[int]) -> list[int]:
    """`ids` with its i-th `image_id` token repeated counts[i] times (Qwen-VL's processor expands each
    <|image_pad|> of the chat text to its image's token count); the number of image tokens must equal len(counts)."""
    found = sum(int(t) == image_id for t in ids)
    if found != len(counts):
        raise PosttrainError(f"the prompt holds {found} image placeholders (token {image_id}) but {len(counts)} "
                             "images were given; give one image per placeholder")
    out, k = [], 0
    for t in ids:
        if int(t) == image_id:
            out += [image_id] * int(counts[k])
            k += 1
        else:
            out.append(int(t))
    return out


def image_prompt(prompt: str, count: int, image_text: str) -> str:
    """`prompt` with each `<image>` replaced by `image_text` (Qwen-VL: <|vision_start|><|image_pad|><|vision_end|>,
    what its chat template writes for an image); a prompt without `<image>` gets the `count` images before its
    text (a Qwen-VL user turn of [image, ..., text]). The number of `<image>` must equal `count`."""
    found = prompt.count("<image>")
    if found == 0:
        return image_text * count + prompt
    if found != count:
        raise PosttrainError(f"the prompt has {found} <image> placeholders but {count} images were given (--image); "
                             "give one image per <image>, or no <image> to put every image before the text")
    return prompt.replace("<image>", image_text)


class ImagePrefill:
    """A Sampler's image stage: `__call__(tokens, segments, images)` -> (positions, delta [B], keywords)."""

    def __init__(self, sampler):
        self.sampler = sampler
        self._encode = jax.jit(self._encode_fn, static_argnames=("grids",))
        self._merge_images = jax.jit(self._merge_fn)

    def _encode_fn(self, weights, tokens, pixels, features, deepstack, grids=None):
        """The keywords of the image rows' prefill: the tower on `pixels` (grids static), or `features` as given."""
        s = self.sampler
        with use_mesh(s.mesh, s.rules):
            s.traces["image_encode"] += 1
            model, _ = s._merge(weights)
            if pixels is not None:
                features, deepstack = model.vision(pixels, grids, dtype=jnp.dtype(model.cfg.dtype))
            return image_embeds(model, tokens, features, deepstack)

    def _merge_fn(self, weights, tokens, pixels):
        """Gemma3VL: the keywords of the prefill, the image tokens' embeddings replaced by the projected images."""
        s = self.sampler
        with use_mesh(s.mesh, s.rules):
            s.traces["image_encode"] += 1
            embeds, image_ids = s._merge(weights)[0].embeds(tokens, pixels)
            return {"embeds": embeds, "image_ids": image_ids}

    def _gemma3(self, tokens, segments, images, vcfg):
        """Gemma 3's branch: plain positions, delta 0, {embeds, image_ids}; each row's image tokens checked."""
        from posttrain.vision.gemma3 import check_image_tokens

        for i, im in enumerate(images):
            if im is not None and im.pixels is None:
                raise PosttrainError("generate: a Gemma 3 model takes each row's images as pixels "
                                     "(vision.preprocess.gemma3_pixels), not features")
            n = 0 if im is None else len(im.pixels)
            check_image_tokens(tokens[i:i + 1], n, vcfg.mm_tokens_per_image, vcfg.image_token_id)
        pixels = jnp.asarray(np.concatenate([im.pixels for im in images if im is not None]), jnp.float32)
        positions = np.maximum(np.cumsum(segments, axis=1) - 1, 0).astype(np.int32)  # the text path's positions
        keywords = self._merge_images(self.sampler._weights, jnp.asarray(tokens), pixels)
        return positions, np.zeros((tokens.shape[0],), np.int32), keywords

    def __call__(self, tokens: np.ndarray, segments: np.ndarray, images: Sequence[Optional[ImageInputs]]):
        """tokens / segments [B, P]: the left-padded prompt bucket; images: one entry (or None) per prompt."""
        from posttrain.vision.gemma3 import Gemma3VisionConfig

        B = tokens.shape[0]
        vcfg = self.sampler.vision
        if not isinstance(vcfg, (VisionConfig, Gemma3VisionConfig)):
            raise PosttrainError("generate: images were given but this model has no vision tower the Sampler "
                                 "knows (Qwen3-VL's, Gemma 3's); load a vision-language folder without text_only")
        if len(images) != B:
            raise PosttrainError(f"generate: images has {len(images)} entries for {B} prompts; give one "
                                 "ImageInputs (or None) per prompt")
        rows = [im for im in images if im is not None]
        if any(not isinstance(im, ImageInputs) for im in rows):
            raise PosttrainError("generate: each images entry must be an ImageInputs or None")
        if isinstance(vcfg, Gemma3VisionConfig):
            return self._gemma3(tokens, segments, images, vcfg)
        if any(im.grids is None for im in rows):
            raise PosttrainError("generate: a Qwen-VL model needs each ImageInputs' grids (qwen_vl_patches gives them)")
        kinds = {im.pixels is None for im in rows}
        if len(kinds) > 1:
            raise PosttrainError("generate: give every row's images as pixels, or every row's as features, not both")
        grids = np.concatenate([im.grids for im in rows]) if rows else np.zeros((0, 3), np.int64)
        positions, delta = rope_index(tokens, segments, grids, vcfg)  # checks tokens against the grids
        w = self.sampler._weights
        if kinds == {False}:  # pixels: the tower runs here, once per distinct tuple of grids
            pixels = jnp.asarray(np.concatenate([im.pixels for im in rows]), jnp.float32)
            keywords = self._encode(w, jnp.asarray(tokens), pixels, None, (),
                                    grids=tuple(map(tuple, grids.tolist())))
        else:
            features = np.concatenate([im.features for im in rows]) if rows else None
            want = int(np.sum(tokens == vcfg.image_token_id))
            if features is None or features.shape[0] != want:
                raise PosttrainError(f"generate: the rows hold {want} image tokens but the features have "
                                     f"{0 if features is None else features.shape[0]} rows")
            depth = {len(im.deepstack) for im in rows}
            if len(depth) > 1:
                raise PosttrainError("generate: every row's ImageInputs must give the same number of deepstack "
                                     "arrays")
            deep = tuple(jnp.asarray(np.concatenate(d)) for d in zip(*(im.deepstack for im in rows)))
            keywords = self._encode(w, jnp.asarray(tokens), None, jnp.asarray(features), deep)
        return positions, delta, keywords

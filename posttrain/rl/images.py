"""Image prompts in GRPO rollouts (Qwen3-VL, Gemma 3; #52): what the sampler and the update need beyond the text path.

What it is: `sampler_images(group)` gives the Sampler each prompt's images (`generate.ImageInputs`, or None for a
text prompt; the n samples of a prompt share its one image prefill), and `add_image_fields(batch, group, vision,
patches)` turns a batch of prefix-shared group rows (`data.branches.group_row`: the prompt once, then its n
completions as branches) into image rows for `vision.batched.forward_rows`:
  positions  int32 [B, 3, L]  the prompt's M-RoPE positions (`rope_index` on the prompt alone), then each branch at
                              the text position it has in the group row (the one it has in an unshared row
                              [prompt | c_i]) + the prompt's delta on all three axes, as the sampler decoded it;
  pixels, patch_* (`vision.batched.TABLE_FIELDS`)  the prompt's patches, padded to `patches` (a static bucket).
The image features then land at the prompt's image tokens (the branches hold none: a sampled image-token id is
text, as in the decode), so every branch token's log-prob equals the unshared row's (tests/test_vlm_grpo.py).

What it is not: the rollout itself (`rl/rollout.py`), the encoding of image prompts (`data/images.py`), or video.
"""

from __future__ import annotations

import numpy as np

from posttrain.data.images import gemma3_image_slots, is_gemma3
from posttrain.generate import ImageInputs
from posttrain.vision.batched import row_tables
from posttrain.vision.qwen_vl import rope_index


def sampler_images(group) -> list | None:
    """The Sampler's `images=` for a batch of prompts: None when none has images (the text path, unchanged)."""
    if all(p.pixels is None for p in group):
        return None
    return [None if p.pixels is None else ImageInputs(grids=p.grids, pixels=p.pixels) for p in group]


def image_positions(prompt_ids, grids, text_positions: np.ndarray, vision) -> np.ndarray:
    """[3, L] M-RoPE positions of one group row: the prompt's own, then text position + delta (padding: 0)."""
    P = len(prompt_ids)
    grids = np.zeros((0, 3), np.int64) if grids is None else grids
    pos, delta = rope_index(np.asarray(prompt_ids)[None], np.ones((1, P), bool), grids, vision)
    out = np.broadcast_to(text_positions + delta[0], (3, len(text_positions))).astype(np.int32)
    out[:, :P] = pos[:, 0]
    return out


def add_image_fields(batch: dict, group, vision, patches: int) -> dict:
    """`batch` (group rows of `group`'s prompts) with [B, 3, L] positions and each prompt's image tables (Gemma 3:
    its 1-D positions and each prompt's images, `data.images.gemma3_image_slots`)."""
    if is_gemma3(vision):
        batch["pixels"] = np.stack([gemma3_image_slots([p.pixels], vision, patches)["pixels"] for p in group])
        return batch
    rows = []
    for i, p in enumerate(group):
        real = batch["segment_ids"][i] != 0
        pos = image_positions(p.ids, p.grids, np.where(real, batch["positions"][i], 0), vision)
        rows.append((np.where(real, pos, 0), p))
    batch["positions"] = np.stack([r[0] for r in rows]).astype(np.int32)
    empty = np.zeros((0, vision.patch_dim), np.float32), np.zeros((0, 3), np.int64)
    tables = [row_tables(*((p.pixels, p.grids) if p.pixels is not None else empty), vision, patches)
              for _, p in rows]
    batch.update({k: np.stack([t[k] for t in tables]) for k in tables[0]})
    return batch

"""Image rows (TRL's vision dataset formats) -> token ids, loss mask, pixel patches and grids.

What it is: a row of TRL's vision formats (https://huggingface.co/docs/trl/dataset_formats#vision-datasets):
  {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "..."}]},
                {"role": "assistant", "content": [{"type": "text", "text": "..."}]}], "images": [...]}
or conversational {"prompt": [messages], "completion": [messages], "images": [...]}, one image per
{"type": "image"} part, in order. An image is a path (relative to the data file's folder, or absolute), bytes
(Parquet), or a `datasets.Image` dict {"bytes": ..., "path": ...} (bytes first; a `datasets` folder's Image
column arrives decoded). The row is encoded as
Qwen3VLProcessor does: the chat template writes <|vision_start|><|image_pad|><|vision_end|> per image part, the
text is tokenised (`formats.tokenize_row`, so the loss mask follows completion_only_loss / assistant_only_loss as
for text rows), then each image's <|image_pad|> becomes qwen_vl_image_tokens(grid) copies carrying its mask value;
the pixels are `posttrain.vision.qwen_vl_patches` with the model folder's processor settings. The ids equal the
processor's (<|image_pad|> is a special token, so expanding it before or after tokenising gives the same ids).

Errors (PosttrainError naming FILE:LINE or FILE:row N, skipped and counted under data.skip_bad_rows like other bad
rows): an image that is missing or unreadable, a count of images different from the image parts, an `images`
column with a text model, a plain-string prompt with images (the template has no place for them).

RL prompt rows (TRL's GRPOTrainer: a `prompt` of messages + `images` or `image`) go through `encode_image_prompt`
(the generation prompt, no loss mask; plain-text turns get their images before the first user turn's text).

Gemma 3 rows (a `gemma3` folder: Gemma3ImageProcessor, the model's `Gemma3VisionConfig`) are encoded as
Gemma3Processor does: the template's <start_of_image> per image part becomes "\n\n" <start_of_image>,
mm_tokens_per_image image tokens, <end_of_image> "\n\n" (the newlines tokenised alone: equal to the processor's
ids when the tokenizer does not merge them with the text around them), pixels [images, 3, S, S]
(`vision.preprocess.gemma3_pixels`); pan-and-scan crops are refused.

What it is not: the batch layout (`pipeline`, `vision.batched.row_tables`), or video.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from posttrain.data.formats import detect_format, messages, tokenize_row
from posttrain.errors import PosttrainError
from posttrain.vision.batched import row_tables
from posttrain.vision.preprocess import ImageSettings, qwen_vl_image_tokens
from posttrain.vision.qwen_vl import rope_index


@dataclass(frozen=True)
class ImageSpec:
    """What encoding an image row needs from the model: its processor settings and vision config (`VisionConfig`:
    the image token id and merge size)."""

    settings: ImageSettings
    vision: object


def image_spec(settings: ImageSettings, vision) -> ImageSpec:
    """An ImageSpec, refusing processors posttrain cannot place in the text yet."""
    if settings.kind == "gemma3" and is_gemma3(vision):
        return _gemma3_spec(settings, vision)
    if settings.kind != "qwen_vl" or vision is None:
        raise PosttrainError(f"{settings.source}: image rows are supported for Qwen3-VL folders (a Qwen2VL image "
                             f"processor and a vision tower); this one is {settings.kind!r}. Use text rows, or a "
                             "qwen3_vl model folder")
    o = settings.options
    dim = 3 * o["temporal_patch_size"] * o["patch_size"] ** 2
    if dim != vision.patch_dim or o["merge_size"] != vision.spatial_merge_size:
        raise PosttrainError(f"{settings.source}: patches of {dim} values, merge {o['merge_size']}, but the vision "
                             f"tower reads {vision.patch_dim}, merge {vision.spatial_merge_size}; the processor file "
                             "and config.json must come from the same checkpoint")
    return ImageSpec(settings, vision)


def has_images(row) -> bool:
    """Whether a row carries images (a non-empty `images` column; Arrow sources give None or [] for none)."""
    return isinstance(row, dict) and row.get("images") not in (None, [])


def row_images(row, where: str, spec) -> list | None:
    """The images of an RL prompt or preference row (TRL's `images` column, or its single `image`), None for a
    text row; an error naming `where` when the row has images but there is no ImageSpec (a text model)."""
    if has_images(row):
        images = row["images"]
    elif isinstance(row, dict) and row.get("image") is not None:
        images = [row["image"]]
    else:
        return None
    if spec is None:
        raise PosttrainError(f"{where}: the row has images but the model is not a vision-language model (or this "
                             "trainer reads text only); drop the 'images' column or use a qwen3_vl or gemma3 folder")
    return images if isinstance(images, list) else [images]


def _parts(msgs: list, where: str, field: str) -> tuple[list, int]:
    """The messages with each content part's null keys dropped (Arrow fills a struct's absent keys with None, which
    the template would read as present), and how many image parts they hold."""
    out, count = [], 0
    for i, m in enumerate(msgs):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict):
                raise PosttrainError(f"{where}: {field}[{i}].content[{j}] must be an object such as "
                                     f'{{"type": "image"}} or {{"type": "text", "text": "..."}}, got {p!r}')
            p = {k: v for k, v in p.items() if v is not None}
            count += p.get("type") == "image"
            parts.append(p)
        out.append({**{k: v for k, v in m.items() if v is not None or k == "content"}, "content": parts})
    return out, count


def _source(image, base: Path, where: str, i: int):
    """What `load_image` reads for images[i]: bytes, a decoded image (a `datasets` folder's Image column), or a path
    resolved against the data file's folder."""
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, dict):
        if image.get("bytes"):
            return image["bytes"]
        image = image.get("path")
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if not isinstance(image, str) or not image:
        raise PosttrainError(f"{where}: images[{i}] must be a path, bytes or {{\"bytes\": ..., \"path\": ...}}, "
                             f"got {image!r}")
    path = Path(image) if os.path.isabs(image) else base / image
    if not path.is_file():
        raise PosttrainError(f"{where}: images[{i}]: no such file {path} (a relative path is read from the data "
                             f"file's folder {base}); fix the path or drop the row")
    return str(path)


def encode_image_row(row: dict, where: str, tok, spec: ImageSpec, base: Path, **format_kw):
    """(ids, loss_mask, pixels [patches, dim] float32, grids [images, 3] int64) of one image row; see the module
    docstring. format_kw goes to `formats.tokenize_row`."""
    fmt = detect_format(row, where)
    images = row["images"]
    if not isinstance(images, list):
        images = [images]
    if fmt not in ("messages", "conversational_prompt_completion"):
        raise PosttrainError(f"{where}: a row with images must be conversational ({{\"messages\": [...]}} or "
                             f"{{\"prompt\": [messages], \"completion\": [messages]}}) with {{\"type\": \"image\"}} "
                             f"content parts where the images go; this one is {fmt!r}")
    fields = ("messages",) if fmt == "messages" else ("prompt", "completion")
    row = dict(row)
    count = 0
    for f in fields:
        if not isinstance(row[f], list):
            raise PosttrainError(f"{where}: field {f!r} must be a list of messages, got {type(row[f]).__name__}")
        row[f], n = _parts(row[f], where, f)
        count += n
    if count != len(images):
        raise PosttrainError(f"{where}: the row has {len(images)} image(s) in 'images' but {count} "
                             f'{{"type": "image"}} content part(s); give one image per image part, in order')
    ids, mask = tokenize_row(row, where, tok, **format_kw)
    if is_gemma3(spec.vision):
        return _expand_gemma3(ids, mask, images, where, spec, base, tok)
    return _expand(ids, mask, images, where, spec, base)


def _first_user_images(msgs: list, count: int) -> list:
    """TRL's `prepare_multimodal_messages` for a prompt without image parts: the first user turn whose content is a
    string gets `count` image parts before its text."""
    out, done = [], False
    for m in msgs:
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str) and not done:
            m = {**m, "content": [{"type": "image"}] * count + [{"type": "text", "text": m["content"]}]}
            done = True
        out.append(m)
    return out


def encode_image_prompt(row: dict, where: str, tok, spec: ImageSpec, base: Path):
    """(ids, pixels, grids) of an RL prompt row with images (TRL's GRPOTrainer rows: a `prompt` of messages with
    {"type": "image"} parts, or plain-text turns whose first user turn then gets the images before its text, as TRL's
    `prepare_multimodal_messages`; the images in `images`, or one in `image`), rendered with the generation prompt
    and each <|image_pad|> expanded as Qwen3VLProcessor does (Gemma 3: each <start_of_image> as Gemma3Processor)."""
    images = row_images(row, where, spec)
    msgs = image_messages(row["prompt"], images, where)
    ids = tok.apply_chat_template(messages({"prompt": msgs}, "prompt", where), add_generation_prompt=True,
                                  where=where)
    return expand_images(ids, images, where, spec, base, tok)


def _expand(ids: list, mask: list, images: list, where: str, spec: ImageSpec, base: Path):
    """(ids, mask, pixels, grids): each image token of `ids` repeated to its image's token count (mask values with
    it), the images read and patched."""
    cfg = spec.vision
    at, (pixels, grids) = _read_images(ids, cfg.image_token_id, "image token", images, where, spec, base)
    counts = qwen_vl_image_tokens(grids, cfg.spatial_merge_size)
    ids, mask = _splice(ids, mask, at, [[ids[i]] * int(c) for i, c in zip(at, counts)])
    return ids, mask, pixels, np.asarray(grids, np.int64)


def _read_images(ids: list, token_id: int, label: str, images: list, where: str, spec: ImageSpec, base: Path):
    """(the indices of `token_id` in ids, the processor's output for the images): one such token per image."""
    at = [i for i, t in enumerate(ids) if t == token_id]
    if len(at) != len(images):
        raise PosttrainError(f"{where}: the chat template wrote {len(at)} {label}(s) (id {token_id}) for "
                             f"{len(images)} image part(s); use the model's own chat template")
    sources = [_source(im, base, where, i) for i, im in enumerate(images)]
    try:
        return at, spec.settings.pixels(sources)
    except PosttrainError as err:
        raise PosttrainError(f"{where}: {err}") from None


def _splice(ids: list, mask: list, at: list, runs: list) -> tuple[list, list]:
    """ids with the token at each index of `at` replaced by its run of tokens (the mask value repeated with it)."""
    out_ids, out_mask, last = [], [], 0
    for i, run in zip(at, runs):
        out_ids += ids[last:i] + run
        out_mask += mask[last:i] + [mask[i]] * len(run)
        last = i + 1
    return out_ids + ids[last:], out_mask + mask[last:]


def patch_bucket(examples, vision) -> int:
    """Patches per row of an image dataset: the most any example has (a multiple of spatial_merge_size^2, as every
    image's patch count is). One per dataset, so one compiled shape; rounding further up (it was to 64) only made
    the tower work on padding: 196 patches of a 224 x 224 image were 256, 30 % more tower work."""
    return group_patch_bucket(examples, [[i] for i in range(len(examples))], vision)


def group_patch_bucket(examples, groups, vision) -> int:
    """`patch_bucket` for rows that each hold a group of examples (packing): the most patches any row's examples
    hold together, rounded up the same way (Gemma 3: the most images of a row, not rounded)."""
    most = max(sum(0 if examples[i].pixels is None else len(examples[i].pixels) for i in g) for g in groups)
    if is_gemma3(vision):  # image slots of a row (Gemma 3: one pixel array per image)
        return max(1, most)
    step = vision.spatial_merge_size ** 2
    return max(step, -(-most // step) * step)


def group_image_fields(group: list, row: dict, vision, patches: int) -> dict:
    """The image fields of one laid-out row (`vision.batched.TABLE_FIELDS`) and its [3, T] M-RoPE positions, for a
    row of one example or several (packing; segment s holds group[s - 1]): the images of all of them, in order, and
    each segment's positions from its own `rope_index` (they restart at 0 in each segment, as one example alone
    would have them). Gemma 3: the row's images as `pixels` [patches, 3, S, S] (`batched.gemma3_forward_rows`)."""
    if is_gemma3(vision):  # Gemma 3: the row's images [patches, 3, S, S], zero after them; positions stay 1-D
        return gemma3_image_slots([ex.pixels for ex in group], vision, patches)
    positions = np.zeros((3, len(row["tokens"])), np.int32)
    pixels, grids = [], []
    for s, ex in enumerate(group, start=1):
        at = row["segment_ids"] == s
        g = ex.grids if ex.grids is not None else np.zeros((0, 3), np.int64)
        try:
            pos, _ = rope_index(row["tokens"][at][None], np.ones((1, int(at.sum())), bool), g, vision)
        except PosttrainError as err:
            raise PosttrainError(f"{ex.where}: {err}") from None
        positions[:, at] = pos[:, 0]
        if ex.pixels is not None:
            pixels.append(ex.pixels)
            grids.append(g)
    pixels = np.concatenate(pixels) if pixels else np.zeros((0, vision.patch_dim), np.float32)
    grids = np.concatenate(grids) if grids else np.zeros((0, 3), np.int64)
    return {"positions": positions, **row_tables(pixels, grids, vision, patches)}


# ----------------------------------------------------------------------------- Gemma 3 image rows


def is_gemma3(vision) -> bool:
    """Whether `vision` is a Gemma 3 folder's Gemma3VisionConfig (images as whole pixel arrays, fixed tokens)."""
    return hasattr(vision, "mm_tokens_per_image")


def gemma3_image_slots(pixels: list, vision, patches: int) -> dict:
    """{"pixels": [patches, 3, S, S]}: the images of a row's examples or prompt (each [n, 3, S, S] or None), in
    order, zero after them (`batched.gemma3_forward_rows` reads them; positions stay the text's)."""
    side = vision.vision.image_size
    out = np.zeros((patches, 3, side, side), np.float32)
    held = [p for p in pixels if p is not None]
    if held:
        held = np.concatenate(held)
        out[:len(held)] = held
    return {"pixels": out}


def _gemma3_spec(settings: ImageSettings, vision) -> ImageSpec:
    o = settings.options
    side = vision.vision.image_size
    if o["pan_and_scan"]:
        raise PosttrainError(f"{settings.source}: do_pan_and_scan is on, but image rows take each image whole "
                             "(pan-and-scan crops add images the rows do not name); set do_pan_and_scan false")
    if tuple(o["size"]) != (side, side):
        raise PosttrainError(f"{settings.source}: images resized to {tuple(o['size'])}, but the vision tower reads "
                             f"{side} x {side}; the processor file and config.json must come from the same checkpoint")
    if settings.image_seq_length != vision.mm_tokens_per_image:
        raise PosttrainError(f"{settings.source}: image_seq_length {settings.image_seq_length}, but config.json's "
                             f"mm_tokens_per_image is {vision.mm_tokens_per_image}; the processor files and "
                             "config.json must come from the same checkpoint")
    return ImageSpec(settings, vision)


def _expand_gemma3(ids: list, mask: list, images: list, where: str, spec: ImageSpec, base: Path, tok):
    """(ids, mask, pixels [images, 3, S, S], None): each <start_of_image> of `ids` replaced by Gemma3Processor's
    full image sequence (mask values with it), the images read and resized."""
    v = spec.vision
    at, pixels = _read_images(ids, v.boi_token_id, "<start_of_image> token", images, where, spec, base)
    newlines = tok.encode("\n\n", add_special_tokens=False)
    run = newlines + [v.boi_token_id] + [v.image_token_id] * v.mm_tokens_per_image + [v.eoi_token_id] + newlines
    ids, mask = _splice(ids, mask, at, [run] * len(at))
    return ids, mask, np.asarray(pixels, np.float32), None


def image_messages(msgs, images: list, where: str, field: str = "prompt") -> list:
    """`msgs` (a conversation with images) with its {"type": "image"} parts, as TRL's `prepare_multimodal_messages`
    gives them: the parts as written (null keys dropped), or, where there are none, `images` before the first user
    turn's text. Errors (naming `where`) on a count of parts that is not the count of images."""
    if not isinstance(msgs, list):
        raise PosttrainError(f"{where}: a {field} with images must be a list of messages (conversational) with "
                             f'{{"type": "image"}} content parts where the images go; this one is '
                             f"{type(msgs).__name__}")
    out, count = _parts(msgs, where, field)
    if count == 0:
        out, count = _parts(_first_user_images(out, len(images)), where, field)
    if count != len(images):
        raise PosttrainError(f"{where}: the row has {len(images)} image(s) but {count} "
                             f'{{"type": "image"}} content part(s); give one image per image part, in order')
    return out


def expand_images(ids: list, images: list, where: str, spec: ImageSpec, base: Path, tok=None):
    """(ids, pixels, grids): each image token of `ids` repeated to its image's token count, as Qwen3VLProcessor
    expands it, and the images read (paths from `base`) and patched; errors name `where`. Gemma 3: each
    <start_of_image> expanded as Gemma3Processor does, pixels [images, 3, S, S], grids None."""
    expand = (lambda *a: _expand_gemma3(*a, tok)) if is_gemma3(spec.vision) else _expand
    ids, _, pixels, grids = expand(list(ids), [0] * len(ids), images, where, spec, base)
    return ids, pixels, grids


def shared_image_fields(prompt_ids, pixels, grids, row: dict, vision, patches: int) -> dict:
    """The image fields of one prefix-shared row [prompt | branches] (`data.branches`, `row` its fields): [3, L]
    M-RoPE positions, the prompt's own (`rope_index` on the prompt alone) and each branch at its text position + the
    prompt's delta (the positions it has in its unshared row [prompt | branch]), 0 on padding; and the prompt's patch
    tables (`vision.batched.TABLE_FIELDS`, padded to `patches`)."""
    if is_gemma3(vision):  # Gemma 3: the row's 1-D positions; the prompt's images padded to `patches` slots
        return gemma3_image_slots([pixels], vision, patches)
    P = len(prompt_ids)
    grids = np.zeros((0, 3), np.int64) if grids is None else grids
    pixels = np.zeros((0, vision.patch_dim), np.float32) if pixels is None else pixels
    pos, delta = rope_index(np.asarray(prompt_ids)[None], np.ones((1, P), bool), grids, vision)
    real = row["segment_ids"] != 0
    out = np.broadcast_to(np.where(real, row["positions"] + delta[0], 0), (3, len(real))).astype(np.int32)
    out[:, :P] = pos[:, 0]
    return {"positions": out, **row_tables(pixels, grids, vision, patches)}

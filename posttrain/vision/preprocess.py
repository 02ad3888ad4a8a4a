"""Image preprocessing for the vision-language families, equal to transformers' image processors, in NumPy + PIL.

What it is: the pixels a vision tower reads, computed exactly as transformers 5.12's PIL backend computes them
(`Gemma3ImageProcessorPil`, `Qwen2VLImageProcessorPil`; the torchvision classes the checkpoints name,
`Gemma3ImageProcessor` / `Qwen2VLImageProcessorFast`, resize with torchvision and differ from the PIL backend by
a few 1/255 steps: posttrain matches the PIL one, the backend transformers uses without torchvision). What it is
not: the tokenizer side (where the image tokens go in the text), the vision tower, or any torch code; it imports
numpy and PIL only.

The steps, in transformers' order and arithmetic (`image_processing_backends.PilBackend`, `image_transforms`):
1. `convert_rgb`: a PIL image whose mode is not "RGB" becomes `image.convert("RGB")`; an RGBA image's alpha is
   dropped (not composited on white), an "L" image's grey level is copied to the three channels. A file or bytes
   is opened, decoded in full, turned by its EXIF orientation (`ImageOps.exif_transpose`) and converted, as
   transformers' `load_image` does for a path.
2. resize with PIL on the uint8 image: Gemma 3 to `size` (896 x 896) with BILINEAR (`resample: 2`); Qwen to
   `smart_resize`'s size with BICUBIC (`resample: 3`, the class default the Qwen3-VL config leaves).
3. rescale: `uint8 -> float64 * rescale_factor -> float32`; then normalise in float32: `(x - mean) / std`.
4. channels first, [3, H, W].
Gemma 3 (SigLIP): every image becomes [3, 896, 896]; each one costs `image_seq_length` (256) tokens. Pan-and-scan
(off unless asked, as Gemma3Processor's defaults) adds crops of a long image after the image itself.
Qwen3-VL (and Qwen2-VL / Qwen2.5-VL, other numbers): `smart_resize` picks H, W as multiples of
patch_size * merge_size with min_pixels <= H * W <= max_pixels keeping the aspect ratio; the image is one frame
repeated to `temporal_patch_size` frames, cut into a (grid_t, grid_h, grid_w) = (1, H / P, W / P) grid of patches,
each flattened as [C, T, P, P], the patches ordered by merge block ([t, h / m, w / m, m, m]) so the merger's
m x m neighbours are consecutive rows; the image gives grid_t * grid_h * grid_w / merge_size^2 tokens.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from posttrain.errors import PosttrainError

BILINEAR = 2  # PIL.Image.Resampling.BILINEAR (= transformers' PILImageResampling.BILINEAR)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC

# Qwen3-VL's preprocessor_config.json (Qwen/Qwen3-VL-*-Instruct): 16-pixel patches, 2 x 2 merge, 256^2..4096^2 pixels.
QWEN3_VL_MIN_PIXELS = 65536
QWEN3_VL_MAX_PIXELS = 16777216
MAX_ASPECT = 200  # smart_resize refuses a longer side over 200 times the shorter one (as transformers)

ImageSource = Any  # a path (str / os.PathLike), bytes, {"bytes": ..., "path": ...}, a PIL image or a uint8 array


def _describe(source: ImageSource, index: int | None) -> str:
    """How an error names the image: its index in the batch and its path when it has one."""
    where = f"image {index}" if index is not None else "image"
    if isinstance(source, (str, os.PathLike)):
        return f"{where} ({os.fspath(source)})"
    if isinstance(source, dict) and source.get("path"):
        return f"{where} ({source['path']})"
    return where


def _open(data: bytes | str | os.PathLike, what: str) -> Image.Image:
    """Open and decode a file or bytes in full (a truncated file fails here, not later), EXIF-turned, RGB."""
    try:
        image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
        image.load()
        image = ImageOps.exif_transpose(image)
    except FileNotFoundError:
        raise PosttrainError(f"{what}: no such file; check the image path (a relative one is read from "
                             f"{os.getcwd()})") from None
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as e:
        raise PosttrainError(f"{what}: not a readable image ({type(e).__name__}: {e}); re-save it as PNG or JPEG, "
                             "or drop the row") from None
    return image


def load_image(source: ImageSource, *, index: int | None = None) -> Image.Image:
    """An RGB PIL image from a path, bytes, a `datasets.Image` dict ({"bytes", "path"}), a PIL image or a uint8
    array ([H, W] grey or [H, W, C] channels-last with C in 1, 3, 4); errors are PosttrainError naming the image.
    A PIL image is converted only when its mode is not RGB (transformers' `convert_rgb`), a file or bytes is also
    turned by its EXIF orientation (transformers' `load_image`)."""
    what = _describe(source, index)
    if isinstance(source, dict):
        if source.get("bytes") is not None:
            source = bytes(source["bytes"])
        elif source.get("path"):
            source = source["path"]
        else:
            raise PosttrainError(f"{what}: an image dict needs 'bytes' or 'path' (datasets.Image's form), got keys "
                                 f"{sorted(source)}")
    if isinstance(source, (bytes, bytearray, memoryview)):
        image = _open(bytes(source), what)
    elif isinstance(source, (str, os.PathLike)):
        image = _open(source, what)
    elif isinstance(source, Image.Image):
        image = source
        try:
            image.load()  # a lazily opened file decodes here: a truncated one fails with its name
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise PosttrainError(f"{what}: not a readable image ({type(e).__name__}: {e})") from None
    elif isinstance(source, np.ndarray):
        array = source[..., 0] if source.ndim == 3 and source.shape[-1] == 1 else source
        if array.dtype != np.uint8 or not (array.ndim == 2 or (array.ndim == 3 and array.shape[-1] in (3, 4))):
            raise PosttrainError(f"{what}: an array image must be uint8 [H, W] or [H, W, 1|3|4] (channels last), "
                                 f"got {array.dtype} {list(source.shape)}")
        image = Image.fromarray(array)
    else:
        raise PosttrainError(f"{what}: expected a path, bytes, a datasets.Image dict, a PIL image or a uint8 array, "
                             f"got {type(source).__name__}")
    if image.width < 1 or image.height < 1:
        raise PosttrainError(f"{what}: the image is empty ({image.width} x {image.height} pixels)")
    try:
        return image if image.mode == "RGB" else image.convert("RGB")
    except (OSError, ValueError) as e:
        raise PosttrainError(f"{what}: mode {image.mode} cannot be converted to RGB ({e})") from None


def _pixels(image: Image.Image, height: int, width: int, resample: int | None, scale: float | None,
            mean: Sequence[float] | None, std: Sequence[float] | None) -> np.ndarray:
    """Resize (when `resample` is not None), rescale, normalise an RGB image -> float32 [3, H, W], transformers'
    arithmetic: PIL's resize on uint8, float64 rescale cast to float32, float32 normalisation."""
    if resample is not None:
        image = image.resize((width, height), resample=resample)
    x = np.asarray(image)  # [H, W, 3] uint8
    if scale is not None:
        x = (x.astype(np.float64) * scale).astype(np.float32)
    elif not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32)
    if mean is not None:
        x = (x - np.asarray(mean, x.dtype)) / np.asarray(std, x.dtype)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def _as_list(images: ImageSource | Sequence[ImageSource]) -> list:
    if isinstance(images, (list, tuple)):
        return list(images)
    return [images]


def _check_stats(image_mean: Sequence[float], image_std: Sequence[float]) -> None:
    if len(image_mean) != 3 or len(image_std) != 3:
        raise PosttrainError(f"image_mean and image_std need 3 values (R, G, B), got {list(image_mean)} and "
                             f"{list(image_std)}")


# ------------------------------------------------------------------ Gemma 3 (SigLIP)


def pan_and_scan_grid(height: int, width: int, *, min_crop_size: int = 256, max_num_crops: int = 4,
                      min_ratio_to_activate: float = 1.2) -> tuple[int, int]:
    """Gemma 3's pan-and-scan: the (rows, columns) of crops of a height x width image, (1, 1) when it gets none
    (not long enough, or the crops would be under min_crop_size). As Gemma3ImageProcessor.pan_and_scan."""
    if width >= height:
        if width / height < min_ratio_to_activate:
            return 1, 1
        cols = int(math.floor(width / height + 0.5))
        cols = min(int(math.floor(width / min_crop_size)), cols)
        rows, cols = 1, min(max_num_crops, max(2, cols))
    else:
        if height / width < min_ratio_to_activate:
            return 1, 1
        rows = int(math.floor(height / width + 0.5))
        rows = min(int(math.floor(height / min_crop_size)), rows)
        rows, cols = min(max_num_crops, max(2, rows)), 1
    if min(int(math.ceil(width / cols)), int(math.ceil(height / rows))) < min_crop_size:
        return 1, 1
    return rows, cols


def _pan_and_scan(image: Image.Image, **options) -> list[Image.Image]:
    """The crops (none, or rows * cols of them, row-major), cut from the uint8 image as transformers' slices
    (the last row / column may be narrower)."""
    rows, cols = pan_and_scan_grid(image.height, image.width, **options)
    if rows * cols == 1:
        return []
    crop_h, crop_w = int(math.ceil(image.height / rows)), int(math.ceil(image.width / cols))
    array = np.asarray(image)
    return [Image.fromarray(array[y:y + crop_h, x:x + crop_w])
            for y, x in itertools.product(range(0, rows * crop_h, crop_h), range(0, cols * crop_w, crop_w))]


def gemma3_pixels(images: ImageSource | Sequence[ImageSource], *, size: int | tuple[int, int] = 896,
                  resample: int = BILINEAR, rescale_factor: float = 1 / 255,
                  image_mean: Sequence[float] = (0.5, 0.5, 0.5), image_std: Sequence[float] = (0.5, 0.5, 0.5),
                  do_resize: bool = True, do_rescale: bool = True, do_normalize: bool = True,
                  pan_and_scan: bool = False, pan_and_scan_min_crop_size: int = 256,
                  pan_and_scan_max_num_crops: int = 4, pan_and_scan_min_ratio_to_activate: float = 1.2) -> np.ndarray:
    """Gemma 3's pixel values: float32 [N, 3, H, W] (H, W = `size`, 896 for the released checkpoints), equal to
    `Gemma3ImageProcessorPil`'s `pixel_values`. With `pan_and_scan`, each image is followed by its crops
    (`gemma3_num_crops` says how many, from the sizes alone); the defaults are Gemma3Processor's."""
    height, width = (size, size) if isinstance(size, int) else size
    _check_stats(image_mean, image_std)
    options = dict(min_crop_size=pan_and_scan_min_crop_size, max_num_crops=pan_and_scan_max_num_crops,
                   min_ratio_to_activate=pan_and_scan_min_ratio_to_activate)
    out = []
    for index, source in enumerate(_as_list(images)):
        image = load_image(source, index=index)
        for im in [image] + (_pan_and_scan(image, **options) if pan_and_scan else []):
            if not do_resize and (im.height, im.width) != (height, width):
                raise PosttrainError(f"{_describe(source, index)} is {im.height} x {im.width} pixels; with do_resize "
                                     f"off every image must already be {height} x {width}")
            out.append(_pixels(im, height, width, resample if do_resize else None,
                               rescale_factor if do_rescale else None,
                               image_mean if do_normalize else None, image_std))
    if not out:
        return np.zeros((0, 3, height, width), np.float32)
    return np.stack(out)


def gemma3_num_crops(sizes: Sequence[tuple[int, int]], *, pan_and_scan: bool = False,
                     pan_and_scan_min_crop_size: int = 256, pan_and_scan_max_num_crops: int = 4,
                     pan_and_scan_min_ratio_to_activate: float = 1.2, **_: Any) -> list[int]:
    """Crops each (height, width) image gets after itself in `gemma3_pixels` (transformers' `num_crops`): 0 without
    pan-and-scan. Every image and crop is `image_seq_length` tokens. Other keyword arguments are ignored, so a
    settings' options pass whole."""
    if not pan_and_scan:
        return [0 for _ in sizes]
    grids = [pan_and_scan_grid(h, w, min_crop_size=pan_and_scan_min_crop_size,
                               max_num_crops=pan_and_scan_max_num_crops,
                               min_ratio_to_activate=pan_and_scan_min_ratio_to_activate) for h, w in sizes]
    return [0 if r * c == 1 else r * c for r, c in grids]


# ------------------------------------------------------------------ Qwen2-VL / Qwen2.5-VL / Qwen3-VL


def smart_resize(height: int, width: int, *, factor: int = 32, min_pixels: int = QWEN3_VL_MIN_PIXELS,
                 max_pixels: int = QWEN3_VL_MAX_PIXELS) -> tuple[int, int]:
    """Qwen's dynamic resolution, as transformers' `smart_resize`: both sides multiples of `factor`
    (patch_size * merge_size), min_pixels <= H * W <= max_pixels, the aspect ratio kept as near as the rounding
    allows (Python's round: halves to even; floor when shrinking, ceil when growing)."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise PosttrainError(f"a {height} x {width} image has an aspect ratio over {MAX_ASPECT} (Qwen's image "
                             "processor refuses it); crop or pad it")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_vl_grid(height: int, width: int, *, patch_size: int = 16, merge_size: int = 2,
                 min_pixels: int = QWEN3_VL_MIN_PIXELS, max_pixels: int = QWEN3_VL_MAX_PIXELS,
                 **_: Any) -> tuple[int, int, int]:
    """(grid_t, grid_h, grid_w) of one height x width image, from its size alone (no pixels read). Other keyword
    arguments are ignored, so a settings' options pass whole."""
    h, w = smart_resize(height, width, factor=patch_size * merge_size, min_pixels=min_pixels, max_pixels=max_pixels)
    return 1, h // patch_size, w // patch_size


def qwen_vl_patches(images: ImageSource | Sequence[ImageSource], *, patch_size: int = 16,
                    temporal_patch_size: int = 2, merge_size: int = 2, min_pixels: int = QWEN3_VL_MIN_PIXELS,
                    max_pixels: int = QWEN3_VL_MAX_PIXELS, resample: int = BICUBIC, rescale_factor: float = 1 / 255,
                    image_mean: Sequence[float] = (0.5, 0.5, 0.5), image_std: Sequence[float] = (0.5, 0.5, 0.5),
                    do_resize: bool = True, do_rescale: bool = True,
                    do_normalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Qwen-VL's flattened patches: (pixel_values float32 [sum of grid_t * grid_h * grid_w, 3 * T * P * P],
    image_grid_thw int64 [N, 3]), equal to `Qwen2VLImageProcessorPil`'s. The defaults are Qwen3-VL's
    (Qwen2-VL / Qwen2.5-VL: patch_size 14, CLIP's mean and std, min_pixels 3136, max_pixels 1003520)."""
    _check_stats(image_mean, image_std)
    factor = patch_size * merge_size
    patches, grids = [], []
    for index, source in enumerate(_as_list(images)):
        image = load_image(source, index=index)
        if do_resize:
            try:
                height, width = smart_resize(image.height, image.width, factor=factor, min_pixels=min_pixels,
                                             max_pixels=max_pixels)
            except PosttrainError as e:
                raise PosttrainError(f"{_describe(source, index)}: {e}") from None
        else:
            height, width = image.height, image.width
            if height % factor or width % factor:
                raise PosttrainError(f"{_describe(source, index)} is {height} x {width} pixels; with do_resize off "
                                     f"both sides must be multiples of patch_size * merge_size = {factor}")
        x = _pixels(image, height, width, resample if do_resize else None, rescale_factor if do_rescale else None,
                    image_mean if do_normalize else None, image_std)  # [C, H, W]
        gh, gw, m, p = height // patch_size, width // patch_size, merge_size, patch_size
        # One frame repeated to T frames (transformers pads the last frame up to a multiple of T): [T, C, H, W].
        frames = np.broadcast_to(x[None], (temporal_patch_size, *x.shape))
        frames = frames.reshape(temporal_patch_size, 3, gh // m, m, p, gw // m, m, p)
        # [h/m, w/m, m, m, C, T, P, P]: merge blocks outermost, then each patch's channels, frames, rows, columns.
        patches.append(frames.transpose(2, 5, 3, 6, 1, 0, 4, 7).reshape(gh * gw, 3 * temporal_patch_size * p * p))
        grids.append((1, gh, gw))
    if not patches:
        return np.zeros((0, 3 * temporal_patch_size * patch_size ** 2), np.float32), np.zeros((0, 3), np.int64)
    return np.concatenate(patches).astype(np.float32, copy=False), np.asarray(grids, np.int64)


def qwen_vl_image_tokens(grid_thw: np.ndarray | Sequence[Sequence[int]], merge_size: int = 2) -> np.ndarray:
    """Image tokens per image: grid_t * grid_h * grid_w / merge_size^2 (the `<|image_pad|>` run Qwen's processor
    puts in the text for each image), int64 [N]."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    return grid.prod(axis=1) // (merge_size ** 2)


# ------------------------------------------------------------------ settings from an HF folder

GEMMA3_TYPES = ("Gemma3ImageProcessor", "Gemma3ImageProcessorFast", "Gemma3ImageProcessorPil")
QWEN_VL_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
GEMMA3_IMAGE_SEQ_LENGTH = 256  # Gemma3Processor's default tokens per image (processor_config.json: image_seq_length)


@dataclass(frozen=True)
class ImageSettings:
    """An HF folder's image processor: `kind` ("gemma3" or "qwen_vl"), `options` (keyword arguments of
    gemma3_pixels / qwen_vl_patches), `image_seq_length` (Gemma 3's tokens per image; None for Qwen, whose count
    is the grid's), `source` (the file read)."""

    kind: str
    options: dict = field(default_factory=dict)
    image_seq_length: int | None = None
    source: str = ""

    def pixels(self, images):
        """gemma3_pixels or qwen_vl_patches with these options."""
        return (gemma3_pixels if self.kind == "gemma3" else qwen_vl_patches)(images, **self.options)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise PosttrainError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(value, dict):
        raise PosttrainError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _get(config: dict, source: str, key: str, default: Any = ..., kind: type | tuple = object) -> Any:
    """config[key]; None or absent is `default` (transformers' class default) or, without one, an error naming
    the file and key."""
    value = config.get(key)
    if value is None:
        if default is ...:
            raise PosttrainError(f"{source}: the key {key!r} is missing; the image processor needs it (copy the "
                                 "file from the model's original checkpoint)")
        return default
    if not isinstance(value, kind) or isinstance(value, bool) and kind in (int, float, (int, float)):
        raise PosttrainError(f"{source}: {key!r} is {value!r}, of the wrong type")
    return value


def _stats(config: dict, source: str, key: str) -> tuple[float, float, float]:
    value = _get(config, source, key, kind=(list, tuple, int, float))
    value = [value] * 3 if isinstance(value, (int, float)) else list(value)
    if len(value) != 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise PosttrainError(f"{source}: {key!r} must be 3 numbers (R, G, B), got {value!r}")
    return tuple(float(v) for v in value)


def processor_settings(folder: str | os.PathLike) -> ImageSettings:
    """The image processor of an HF folder, read as transformers does: processor_config.json's nested
    "image_processor" if it has one, else preprocessor_config.json. Keys transformers' class fills in when they
    are absent or null (resample, rescale_factor, do_*) get that default; the ones that define the model's input
    (size, mean, std, Qwen's patch sizes) must be there: a missing one is a PosttrainError naming the file and key."""
    folder = os.fspath(folder)
    proc_path = os.path.join(folder, "processor_config.json")
    pre_path = os.path.join(folder, "preprocessor_config.json")
    processor = _read_json(proc_path) if os.path.isfile(proc_path) else {}
    if isinstance(processor.get("image_processor"), dict):
        config, source = processor["image_processor"], f"{proc_path} (image_processor)"
    elif os.path.isfile(pre_path):
        config, source = _read_json(pre_path), pre_path
    else:
        raise PosttrainError(f"{folder}: no preprocessor_config.json (nor an image_processor in "
                             "processor_config.json); a vision-language folder needs its image processor's file")
    kind_name = _get(config, source, "image_processor_type", kind=str)
    common = dict(rescale_factor=float(_get(config, source, "rescale_factor", 1 / 255, (int, float))),
                  image_mean=_stats(config, source, "image_mean"), image_std=_stats(config, source, "image_std"),
                  do_resize=_get(config, source, "do_resize", True, bool),
                  do_rescale=_get(config, source, "do_rescale", True, bool),
                  do_normalize=_get(config, source, "do_normalize", True, bool))
    if _get(config, source, "do_convert_rgb", True, bool) is False:
        raise PosttrainError(f"{source}: do_convert_rgb false is not supported (posttrain converts every image to "
                             "RGB, as the Gemma 3 and Qwen-VL checkpoints do); remove the key")
    if kind_name in GEMMA3_TYPES:
        size = _get(config, source, "size", kind=(dict, int))
        if isinstance(size, int):
            size = {"height": size, "width": size}
        if not isinstance(size.get("height"), int) or not isinstance(size.get("width"), int):
            raise PosttrainError(f"{source}: 'size' must be {{'height': H, 'width': W}}, got {size!r}")
        seq = processor.get("image_seq_length", config.get("image_seq_length", GEMMA3_IMAGE_SEQ_LENGTH))
        options = dict(size=(size["height"], size["width"]), resample=_get(config, source, "resample", BILINEAR, int),
                       pan_and_scan=_get(config, source, "do_pan_and_scan", False, bool),
                       pan_and_scan_min_crop_size=_get(config, source, "pan_and_scan_min_crop_size", 256, int),
                       pan_and_scan_max_num_crops=_get(config, source, "pan_and_scan_max_num_crops", 4, int),
                       pan_and_scan_min_ratio_to_activate=float(
                           _get(config, source, "pan_and_scan_min_ratio_to_activate", 1.2, (int, float))),
                       **common)
        return ImageSettings("gemma3", options, int(seq), source)
    if kind_name in QWEN_VL_TYPES:
        size = config.get("size") or {}
        if not isinstance(size, dict):
            raise PosttrainError(f"{source}: 'size' must be {{'shortest_edge': MIN_PIXELS, 'longest_edge': "
                                 f"MAX_PIXELS}}, got {size!r}")
        # As Qwen2VLImageProcessor.__init__: min_pixels / max_pixels, when given, win over size.
        pixels = {"shortest_edge": config.get("min_pixels", size.get("shortest_edge")),
                  "longest_edge": config.get("max_pixels", size.get("longest_edge"))}
        options = dict(patch_size=_get(config, source, "patch_size", kind=int),
                       temporal_patch_size=_get(config, source, "temporal_patch_size", kind=int),
                       merge_size=_get(config, source, "merge_size", kind=int),
                       min_pixels=_get(pixels, f"{source} (size or min_pixels)", "shortest_edge", kind=int),
                       max_pixels=_get(pixels, f"{source} (size or max_pixels)", "longest_edge", kind=int),
                       resample=_get(config, source, "resample", BICUBIC, int), **common)
        return ImageSettings("qwen_vl", options, None, source)
    raise PosttrainError(f"{source}: image_processor_type {kind_name!r} is not one posttrain implements; it reads "
                         f"{', '.join(GEMMA3_TYPES + QWEN_VL_TYPES)}")

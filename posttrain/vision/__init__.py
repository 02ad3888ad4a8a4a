"""Vision-language inputs (issue #52): image preprocessing equal to transformers' image processors for Gemma 3
(SigLIP) and Qwen-VL (Qwen2-VL / Qwen2.5-VL / Qwen3-VL dynamic resolution), NumPy + PIL only, no torch."""

from posttrain.vision.preprocess import (
    BICUBIC,
    BILINEAR,
    ImageSettings,
    gemma3_num_crops,
    gemma3_pixels,
    load_image,
    pan_and_scan_grid,
    processor_settings,
    qwen_vl_grid,
    qwen_vl_image_tokens,
    qwen_vl_patches,
    smart_resize,
)

__all__ = [
    "BICUBIC",
    "BILINEAR",
    "ImageSettings",
    "gemma3_num_crops",
    "gemma3_pixels",
    "load_image",
    "pan_and_scan_grid",
    "processor_settings",
    "qwen_vl_grid",
    "qwen_vl_image_tokens",
    "qwen_vl_patches",
    "smart_resize",
]

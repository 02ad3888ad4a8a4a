"""Models: one Transformer for every supported family, its config, and Hugging Face I/O."""

from posttrain.models.config import PRESETS, ModelConfig, RopeConfig, preset
from posttrain.models.transformer import KVCache, ModelOutput, Transformer, count_params, with_compute_dtype

__all__ = ["PRESETS", "ModelConfig", "RopeConfig", "preset", "KVCache", "ModelOutput", "Transformer",
           "count_params", "with_compute_dtype"]

from posttrain.models.hf import from_pretrained, load_config, save_pretrained  # noqa: E402

__all__ += ["from_pretrained", "load_config", "save_pretrained"]

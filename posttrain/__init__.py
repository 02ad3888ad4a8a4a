"""posttrain: JAX-native post-training of language models.

Table of contents (explicit re-exports, grouped; each loads on first use, so `import posttrain`
and the `posttrain` command's parser stay cheap: no JAX, transformers or orbax until a name needs them):
- errors: PosttrainError, the one exception type for user-caused problems
- models: ModelConfig, Transformer, from_pretrained, save_pretrained, presets
- tokenizer: Tokenizer, byte_tokenizer
- generate: Sampler, SamplingParams
- rewards: RewardModel (a trained reward model scoring (prompt, completion) pairs)
- pipeline: Pipeline (one trainer, or a chain of them, from Python or a YAML file)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from posttrain import _xla_defaults  # noqa: F401  (must run before JAX is imported: every submodule import runs this)

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "PosttrainError": "posttrain.errors",
    "Completions": "posttrain.generate", "Sampler": "posttrain.generate", "SamplingParams": "posttrain.generate",
    "PRESETS": "posttrain.models", "KVCache": "posttrain.models", "ModelConfig": "posttrain.models",
    "Transformer": "posttrain.models", "count_params": "posttrain.models", "from_pretrained": "posttrain.models",
    "preset": "posttrain.models", "save_pretrained": "posttrain.models",
    "Pipeline": "posttrain.pipeline",
    "RewardModel": "posttrain.rewards",
    "Tokenizer": "posttrain.tokenizer", "byte_tokenizer": "posttrain.tokenizer",
}

__all__ = [
    "PosttrainError",
    "Completions", "Sampler", "SamplingParams",
    "PRESETS", "KVCache", "ModelConfig", "Transformer", "count_params", "from_pretrained", "preset",
    "save_pretrained",
    "Pipeline",
    "RewardModel",
    "Tokenizer", "byte_tokenizer",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from posttrain.errors import PosttrainError
    from posttrain.generate import Completions, Sampler, SamplingParams
    from posttrain.models import (
        PRESETS,
        KVCache,
        ModelConfig,
        Transformer,
        count_params,
        from_pretrained,
        preset,
        save_pretrained,
    )
    from posttrain.pipeline import Pipeline
    from posttrain.rewards import RewardModel
    from posttrain.tokenizer import Tokenizer, byte_tokenizer

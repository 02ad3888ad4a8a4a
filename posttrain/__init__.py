"""posttrain: JAX-native post-training of language models.

Table of contents (explicit re-exports, grouped):
- errors: PosttrainError, the one exception type for user-caused problems
- models: ModelConfig, Transformer, from_pretrained, save_pretrained, presets
- tokenizer: Tokenizer, byte_tokenizer
- generate: Sampler, SamplingParams
- rewards: RewardModel (a trained reward model scoring (prompt, completion) pairs)
- pipeline: Pipeline (one trainer, or a chain of them, from Python or a YAML file)
"""

from posttrain import _xla_defaults  # noqa: F401  (must run before JAX is imported)
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

__all__ = [
    "PosttrainError",
    "Completions", "Sampler", "SamplingParams",
    "PRESETS", "KVCache", "ModelConfig", "Transformer", "count_params", "from_pretrained", "preset",
    "save_pretrained",
    "Pipeline",
    "RewardModel",
    "Tokenizer", "byte_tokenizer",
]

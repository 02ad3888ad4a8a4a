"""Rewards for the RL trainers: scorers of (prompt, completion) pairs.

`RewardModel(path).score(prompts, completions) -> np.ndarray [N]`: a trained reward model (a HF
`*ForSequenceClassification` folder, e.g. from `posttrain rm` + `export_rm_run`).
"""

from posttrain.rewards.functions import (
    THINK_FORMAT,
    CodeTests,
    FormatReward,
    LengthReward,
    MathAnswer,
    OverlongPenalty,
    RewardFunc,
    RewardModelReward,
    answers_match,
    boxed_contents,
    code_tests,
    code_tests_reward,
    countdown,
    countdown_valid,
    extract_answer,
    format_reward,
    length_reward,
    math_answer,
    math_answer_reward,
    normalize_answer,
    overlong_penalty,
    reward_model_reward,
    safe_arithmetic,
)
from posttrain.rewards.model import RewardModel, tokenize_completion
from posttrain.rewards.runner import combine, reward_names, score

__all__ = [
    "RewardModel",
    "tokenize_completion",
    "RewardFunc",
    "score",
    "combine",
    "reward_names",
    "math_answer",
    "math_answer_reward",
    "countdown",
    "countdown_valid",
    "code_tests",
    "code_tests_reward",
    "CodeTests",
    "safe_arithmetic",
    "MathAnswer",
    "extract_answer",
    "boxed_contents",
    "normalize_answer",
    "answers_match",
    "format_reward",
    "FormatReward",
    "THINK_FORMAT",
    "length_reward",
    "LengthReward",
    "overlong_penalty",
    "OverlongPenalty",
    "reward_model_reward",
    "RewardModelReward",
]

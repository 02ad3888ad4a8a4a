"""Rewards for the RL trainers: scorers of (prompt, completion) pairs.

`RewardModel(path).score(prompts, completions) -> np.ndarray [N]`: a trained reward model (a HF
`*ForSequenceClassification` folder, e.g. from `posttrain rm` + `export_rm_run`).
"""

from posttrain.rewards.model import RewardModel, tokenize_completion

__all__ = ["RewardModel", "tokenize_completion"]

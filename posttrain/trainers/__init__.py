"""Trainer recipes (config, data -> batches and loss over `train.lifecycle.run_trainer`), and their registry.

`TRAINERS` maps a task name (the CLI subcommand, a pipeline stage's `task`) to its recipe;
`trainer_classes(task)` imports it and returns (config class, trainer class).
"""

from __future__ import annotations

import importlib

# task -> (module under posttrain.trainers, config class, trainer class, help)
TRAINERS = {
    "sft": ("sft", "SFTConfig", "SFTTrainer", "supervised fine-tuning (full or LoRA) from a YAML config"),
    "dpo": ("dpo", "DPOConfig", "DPOTrainer", "direct preference optimisation (DPO family) from a YAML config"),
    "rm": ("reward_model", "RMConfig", "RMTrainer", "reward model: a score head trained Bradley-Terry"),
    "grpo": ("grpo", "GRPOConfig", "GRPOTrainer", "GRPO-family RL with reward functions from a YAML config"),
    "ppo": ("ppo", "PPOConfig", "PPOTrainer", "PPO with a critic, GAE and KL-shaped rewards from a YAML config"),
    "distill": ("distill", "DistillConfig", "DistillTrainer", "knowledge distillation of a teacher into a student"),
}


def trainer_classes(task: str):
    """(config class, trainer class) of a task in TRAINERS."""
    from posttrain import config as C

    module, cfg_name, trainer_name, _ = TRAINERS[task]
    mod = importlib.import_module(f"posttrain.trainers.{module}")
    return getattr(C, cfg_name, None) or getattr(mod, cfg_name), getattr(mod, trainer_name)

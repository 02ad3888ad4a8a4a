"""The recipes (one `train.recipe.Recipe` per module) and their registry.

`TRAINERS` maps a recipe's name (the CLI subcommand, a pipeline stage's `task`, the name written
into a run folder's run.json) to its module and help line; `recipe_class(name)` imports the module
and returns its `RECIPE`. Nothing here imports JAX: `posttrain --help` reads TRAINERS alone.
`guess_recipe(raw_config)` names the recipe of a config that does not say it (a `posttrain plan`
config file, or a run folder written before run.json existed) from the sections it holds.
"""

from __future__ import annotations

import importlib

# name -> (module under posttrain.trainers, help)
TRAINERS = {
    "sft": ("sft", "supervised fine-tuning (full or LoRA) from a YAML config"),
    "dpo": ("dpo", "direct preference optimisation (DPO family) from a YAML config"),
    "rm": ("reward_model", "reward model: a score head trained Bradley-Terry"),
    "grpo": ("grpo", "GRPO-family RL with reward functions from a YAML config"),
    "ppo": ("ppo", "PPO with a critic, GAE and KL-shaped rewards from a YAML config"),
    "distill": ("distill", "knowledge distillation of a teacher into a student"),
}


def recipe_class(name: str):
    """The Recipe subclass registered as `name` in TRAINERS."""
    return importlib.import_module(f"posttrain.trainers.{TRAINERS[name][0]}").RECIPE


def guess_recipe(raw: dict) -> str:
    """The recipe a config dict (its YAML, parsed) is for, by the recipe-specific section it holds;
    a GRPO config that keeps every grpo default is known by its prompt data section; else sft."""
    keys = set(raw)
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    for name, section in (("ppo", "ppo"), ("dpo", "dpo"), ("grpo", "grpo"), ("distill", "distill"),
                          ("distill", "teacher"), ("rm", "rm")):
        if section in keys:
            return name
    if "max_prompt_length" in data and "max_length" not in data:
        return "grpo"
    return "sft"

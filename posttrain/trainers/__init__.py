"""The recipes (one `recipes.recipe.Recipe` per module) and their registry.

`TRAINERS` maps a recipe's name (the CLI subcommand, a pipeline stage's `recipe`, the name written
into a run folder's run.json) to its module and help line. It is read from the modules' source
(their recipe class's `name` and `help`), not by importing them: nothing here imports JAX, so
`posttrain --help` stays fast, and a new trainer is found by dropping its module here.
`recipe_class(name)` imports the module and returns its `RECIPE`. `guess_recipe(raw_config)` names
the recipe of a config that does not say it (a `posttrain plan` config file, or a run folder
written before run.json existed) from the sections it holds.
"""

from __future__ import annotations

import ast
import importlib
import os

# the order --help lists them in; others follow
ORDER = ("sft", "dpo", "kto", "rm", "grpo", "ppo", "online_dpo", "distill")


def scan(folders=None) -> dict[str, tuple[str, str]]:
    """name -> (module, help) of every module in `folders` (default: this package's) whose class sets
    `name = "..."` and `help = "..."`."""
    found = {}
    for folder in folders or __path__:
        found.update(_scan_folder(folder))
    return dict(sorted(found.items(), key=lambda kv: (ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER), kv[0])))


def _scan_folder(folder: str) -> dict[str, tuple[str, str]]:
    found = {}
    for file in sorted(os.listdir(folder)):
        if not file.endswith(".py") or file == "__init__.py":
            continue
        with open(os.path.join(folder, file), encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), file)
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            attrs = {t.id: n.value.value for n in cls.body if isinstance(n, ast.Assign)
                     for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
            if isinstance(attrs.get("name"), str) and isinstance(attrs.get("help"), str):
                found[attrs["name"]] = (file[:-3], attrs["help"])
    return found


TRAINERS = scan()  # name -> (module under posttrain.trainers, help)


def recipe_class(name: str):
    """The Recipe subclass registered as `name` in TRAINERS."""
    return importlib.import_module(f"posttrain.trainers.{TRAINERS[name][0]}").RECIPE


def guess_recipe(raw: dict) -> str:
    """The recipe a config dict (its YAML, parsed) is for: the recipe whose name is one of its top-level
    sections (each recipe's own section: dpo, rm, grpo, ppo, distill, ...); a distillation config known
    by its teacher, a GRPO config that keeps every grpo default by its prompt data section; else sft."""
    keys = set(raw)
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    named = [name for name in TRAINERS if name in keys and name != "sft"]
    if named:
        return named[0]
    if "teacher" in keys:
        return "distill"
    if "max_prompt_length" in data and "max_length" not in data:
        return "grpo"
    return "sft"

"""Finished runs: which recipe wrote a run folder, its trained model, and its exports.

What it is: `run_recipe(run_dir)` (run.json's name; a folder written before run.json existed is
named by its config's sections), `load_run(run_dir) -> (config, tokenizer, model)` (the recipe's
`run_model` with `trainable.safetensors` loaded, LoRA adapters still separate),
`export_run(run_dir, out, dtype, overwrite)` (a Hugging Face folder, LoRA merged; a reward model
as `*ForSequenceClassification`), `export_run_gguf(run_dir, path, gguf_type)` (one GGUF file) and
`export_folder_gguf(model_dir, path, gguf_type)` (a Hugging Face folder and its tokenizer as one GGUF file:
here, not in models/, since models/ never imports the tokenizer).

What it is not: training (`recipes.recipe`) or the file formats (`models.hf`, `models.gguf`).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import yaml
from flax import nnx

from posttrain import config as C
from posttrain import trainers
from posttrain.errors import PosttrainError
from posttrain.models import save_pretrained
from posttrain.models.hf import canonical_dtype, check_export_target
from posttrain.models.lora import merge_lora
from posttrain.recipes.build import build_tokenizer
from posttrain.recipes.lifecycle import RUN_FILE
from posttrain.train.serialize import load_state
from posttrain.train.trainer import WEIGHTS
from posttrain.trainers import guess_recipe, recipe_class


def config_recipe(cfg_file: str) -> str:
    """The recipe a config file is for, by its sections (`trainers.guess_recipe`); an unreadable file is
    left to `config.load`, which names it with its location."""
    try:
        with open(cfg_file) as fh:
            raw = yaml.safe_load(fh) or {}
    except (OSError, yaml.YAMLError):
        return "sft"
    return guess_recipe(raw) if isinstance(raw, dict) else "sft"


def run_recipe(run_dir: str) -> str:
    """The name of the recipe that wrote `run_dir`: run.json's, else guessed from config.yaml."""
    path = os.path.join(run_dir, RUN_FILE)
    if os.path.isfile(path):
        try:
            with open(path) as fh:
                name = json.load(fh).get("recipe")
        except (OSError, ValueError, AttributeError):
            name = None
        if name not in trainers.TRAINERS:
            raise PosttrainError(f"{path}: not a run file of this posttrain (recipe {name!r}); it should read "
                                 f'{{"recipe": one of {", ".join(trainers.TRAINERS)}}}')
        return name
    return config_recipe(os.path.join(run_dir, "config.yaml"))


def load_run(run_dir: str):
    """(config, tokenizer, trained model) of a finished run (LoRA adapters still separate)."""
    return _load(run_dir)[1:]


def best_step(run_dir: str) -> tuple[int, float]:
    """(step, value) of a run's best evaluated checkpoint (checkpoint.best_metric), or a PosttrainError."""
    from posttrain.train.checkpoint import Checkpointer

    config = C.load(recipe_class(run_recipe(run_dir)).config_class, os.path.join(run_dir, "config.yaml"))
    c = config.checkpoint
    folder = os.path.join(run_dir, "checkpoints")
    if not c.best_metric:
        raise PosttrainError(f"{run_dir}: --best needs a run trained with checkpoint.best_metric set (and an "
                             "evaluation: train.eval_every, data.eval); this run has none")
    best = Checkpointer(folder, keep=c.keep, async_save=False, best_metric=c.best_metric,
                        best_mode=c.best_mode).best() if os.path.isdir(folder) else None
    if best is None:
        raise PosttrainError(f"{folder}: no checkpoint holds an evaluation of {c.best_metric}; the run stopped "
                             "before its first evaluation")
    return best


def _load(run_dir: str, best: bool = False):
    """(recipe class, config, tokenizer, trained model) of a finished run; with `best` the weights of its
    best evaluated checkpoint instead of the last step's."""
    cfg_file = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(cfg_file):
        raise PosttrainError(f"{cfg_file}: missing; --run must be a folder written by a posttrain trainer")
    recipe = recipe_class(run_recipe(run_dir))
    config = C.load(recipe.config_class, cfg_file)
    tok = build_tokenizer(config.model)
    model, trainable = recipe.run_model(config, tok)
    graphdef, params, rest = nnx.split(model, trainable, ...)
    if best:
        from posttrain.train.checkpoint import Checkpointer

        step, _ = best_step(run_dir)
        folder = os.path.join(run_dir, "checkpoints")
        arrays = Checkpointer(folder, async_save=False).restore_params(step)
        params = load_state(f"{folder}/{step}", params, arrays=arrays)
    else:
        params = load_state(os.path.join(run_dir, WEIGHTS), params)
    return recipe, config, tok, nnx.merge(graphdef, params, rest)


def trained_model(run_dir: str, *, best: bool = False):
    """(tokenizer, the trained model of a run as `posttrain export` writes it: the recipe's `exported`, LoRA
    merged); `best`: the weights of the best evaluated checkpoint (`best_step`)."""
    return _exported(run_dir, best)


def _exported(run_dir: str, best: bool = False):
    """(tokenizer, the module `posttrain export` writes: the recipe's `exported`, LoRA merged)."""
    recipe, config, tok, model = _load(run_dir, best)
    model = recipe.exported(config, model)
    if config.lora.enabled:
        merge_lora(model)
    return tok, model


def export_run(run_dir: str, out: str, dtype: Optional[str] = None, overwrite: bool = False,
               best: bool = False) -> str:
    """Write a finished run as a Hugging Face folder (LoRA merged into the base weights); a reward
    model as a `*ForSequenceClassification` folder. `out` may not be the run folder (nor hold it, nor be
    inside its own files such as checkpoints/); an existing `out` is replaced only when it is empty or a
    previous export, or with `overwrite` (`models.hf.check_export_target`). Both are checked, and
    `dtype` read (fp16, bf16, ... accepted), before the run is loaded. `best`: the best evaluated
    checkpoint's weights (checkpoint.best_metric) instead of the last step's."""
    dtype = canonical_dtype(dtype, "--dtype")
    check_export_target(out, overwrite, run_dir=run_dir)
    if best:
        best_step(run_dir)  # no such step: fail before anything is written
    tok, model = _exported(run_dir, best)
    return save_pretrained(model, out, tokenizer=tok, dtype=dtype, overwrite=overwrite, files=_processor_files(run_dir))


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def _processor_files(run_dir: str) -> list[str]:
    """The image processor files of the run's model.path folder (a vision-language model's export reads images with
    them); none for a text model, a preset or `model.text_only`."""
    with open(os.path.join(run_dir, "config.yaml")) as fh:
        model = (yaml.safe_load(fh) or {}).get("model") or {}
    base = model.get("path")
    if not base or model.get("text_only"):
        return []
    return [os.path.join(base, f) for f in PROCESSOR_FILES if os.path.isfile(os.path.join(base, f))]


def export_run_gguf(run_dir: str, path: str, gguf_type: str = "f32", best: bool = False) -> str:
    """Write a finished run as one GGUF file (LoRA merged, as export_run does); a reward model is refused."""
    from posttrain.models.gguf import GGUF_TYPES, export_gguf

    if gguf_type not in GGUF_TYPES:
        raise PosttrainError(f"--gguf-type {gguf_type!r}: use one of {', '.join(GGUF_TYPES)}")
    if os.path.isfile(os.path.join(run_dir, "config.yaml")) and run_recipe(run_dir) == "rm":
        raise PosttrainError(f"{run_dir}: a reward model run has a score head, which GGUF cannot hold; export it as "
                             "a Hugging Face folder with --out")
    tok, model = _exported(run_dir, best)
    return export_gguf(model, tok, path, gguf_type, name=os.path.basename(os.path.abspath(run_dir)))


def export_folder_gguf(model_dir: str, path: str, gguf_type: str = "f32") -> str:
    """`posttrain export --model DIR --gguf OUT.gguf`: any Hugging Face folder posttrain loads, with its tokenizer,
    as one GGUF file."""
    from posttrain.models.gguf import GGUF_TYPES, export_gguf
    from posttrain.models.hf import from_pretrained
    from posttrain.tokenizer import Tokenizer

    if gguf_type not in GGUF_TYPES:
        raise PosttrainError(f"--gguf-type {gguf_type!r}: use one of {', '.join(GGUF_TYPES)}")
    tok = Tokenizer.from_pretrained(model_dir)
    return export_gguf(from_pretrained(model_dir), tok, path, gguf_type, name=os.path.basename(model_dir.rstrip("/")))

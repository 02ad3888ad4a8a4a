"""One object for a training job or a chain of them: `Pipeline(...)`, and `posttrain run pipeline.yaml`.

What it is: a list of stages, each a normal trainer run (`posttrain.trainers.TRAINERS`: sft, dpo,
rm, grpo, ppo, distill) in `<run_dir>/<stage name>/`, exported to `<run_dir>/<stage name>/hf` (a
Hugging Face folder). A stage's config is its trainer's config (the same keys as the trainer's
YAML file, checked by the same typed config), built from, in order: the stage's `config:` file
(optional), the pipeline's `defaults:`, the stage's own keys. A stage without a `model` trains the
model the previous stage produced (the pipeline's `model` for the first stage): each stage's
output model is the next one's input. Two exceptions: a `distill` stage takes the previous model
as its `teacher` (its `model` is the student, given explicitly), and an `rm` stage's output (a
reward model) is not a policy, so the stage after it continues from the policy before it. A
string value `@NAME` anywhere in a stage is the Hugging Face folder of the earlier stage NAME
(e.g. `ppo: {reward_model: "@rm"}`).

    Pipeline(recipe="sft", model="demo-tiny", run_dir="runs/x", train={"steps": 100}).run("rows.jsonl")
    Pipeline(stages=[{"recipe": "sft", ...}, {"recipe": "grpo", ...}], model="path/to/hf").run()

A stage names its trainer with `recipe:`; the older `task:` (and `Pipeline(task=...)`) is read, with a
FutureWarning, until the next release.

A finished stage leaves `<stage>/stage.json` (its result) after its export; running the same
pipeline again skips finished stages (checking their config is unchanged) and the trainer of the
first unfinished one resumes from its newest checkpoint, so a killed chain continues at the stage
and step where it stopped. Every stage's config is checked before the first one starts.

What it is not: a scheduler (stages run one after the other in this process) or a new trainer.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import yaml

from posttrain import config as C
from posttrain.errors import PosttrainError
from posttrain.trainers import TRAINERS, recipe_class

TOP_KEYS = ("run_dir", "model", "sharding", "defaults", "stages")
STAGE_KEYS = ("recipe", "task", "name", "config")  # a stage's own keys (task: recipe's old name); the rest config
DONE = "stage.json"
FROM_RUN = "<the dataset given to Pipeline.run>"


def _merge(base: dict, extra: Mapping) -> dict:
    """`base` updated recursively with `extra` (mappings merge, other values replace); a new dict."""
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _model_spec(model, where: str, key: str = "model") -> dict:
    """A model section from a folder path, a preset name, or a mapping of ModelSection keys."""
    from posttrain.models import PRESETS

    if model is None or isinstance(model, Mapping):
        return dict(model or {})
    if isinstance(model, str):
        if model in PRESETS:
            return {"preset": model}
        if os.path.isdir(model) or "/" in model or model.startswith("@"):
            return {"path": model}  # a folder (checked by the trainer) or a stage reference
        close = difflib.get_close_matches(model, list(PRESETS), n=1)
        raise PosttrainError(f"{where}: '{key}' is {model!r}: neither a folder nor a preset"
                             + (f" (did you mean '{close[0]}'?)" if close else
                                f"; presets: {', '.join(sorted(PRESETS))}"))
    raise PosttrainError(f"{where}: '{key}' must be a folder, a preset name or a mapping, got {model!r}")


def _dotted(d: Mapping) -> dict:
    """{"optim.lr": 1e-3, "train": {...}} -> nested dicts (keyword overrides may use dotted keys)."""
    out: dict = {}
    for key, value in d.items():
        parts = key.split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return _merge({}, out)


def _has_weights(m: Mapping) -> bool:
    return bool(m.get("path") or m.get("preset"))


def _chain_model(base: Mapping, own: Mapping, policy: Optional[Mapping], where: str, hint: str) -> dict:
    """A stage's model section: its own path / preset, else the chained `policy`, else its config file's;
    other keys (dtype, tokenizer, ...) from the file, then the stage's own."""
    if _has_weights(own) or policy:
        base = {k: v for k, v in base.items() if k not in ("path", "preset")}
    model = _merge(base, own if _has_weights(own) or not policy else _merge(dict(policy), own))
    if not _has_weights(model):
        raise PosttrainError(f"{where}: no model: give " + (hint or "the stage's 'model'")
                             + " (a Hugging Face folder or a preset)")
    return model


def _substitute(value, hf: dict, where: str, key: str = ""):
    """Replace every string '@NAME' in a stage config by the HF folder of earlier stage NAME."""
    if isinstance(value, Mapping):
        return {k: _substitute(v, hf, where, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, hf, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str) and value.startswith("@"):
        if value[1:] not in hf:
            raise PosttrainError(f"{where}: '{key}' is {value!r}, but no earlier stage is named {value[1:]!r} "
                                 f"(earlier stages: {', '.join(hf) or 'none'})")
        return hf[value[1:]]
    return value


def _renamed_task(where: str) -> None:
    import warnings

    warnings.warn(f"{where}: a stage's 'task' is now called 'recipe'; the old name is read until the next release",
                  FutureWarning, stacklevel=3)


class Stage:
    """One trainer run of a pipeline: its name, recipe, typed config and folder."""

    def __init__(self, name: str, recipe: str, config, where: str):
        self.name, self.recipe, self.config, self.where = name, recipe, config, where
        self.run_dir = config.run_dir
        self.hf = os.path.join(config.run_dir, "hf")

    def done(self, inputs: dict) -> Optional[dict]:
        """The record of a finished stage (its stage.json: id, inputs, result), or None. `inputs` are the
        ids of the earlier stages now; a stage trained from other ones is an error, never skipped."""
        path = os.path.join(self.run_dir, DONE)
        if not (os.path.isfile(path) and os.path.isfile(os.path.join(self.hf, "config.json"))):
            return None
        with open(path) as fh:
            record = json.load(fh)
        self.check_inputs(record.get("inputs"), inputs)
        return record

    def check_inputs(self, recorded: Optional[dict], inputs: dict) -> None:
        if recorded is not None and recorded != inputs:
            changed = sorted(k for k in set(recorded) | set(inputs) if recorded.get(k) != inputs.get(k))
            raise PosttrainError(f"{self.where}: {self.run_dir} was trained after other runs of the stages "
                                 f"{changed}; use a new run_dir, or {self.name}.checkpoint.resume=false to train "
                                 "this stage afresh")


class Pipeline:
    """A training job: one recipe (`recipe=`, `model=`, keyword config sections) or a chain (`stages=`).

    `model`: a Hugging Face folder, a preset name or a ModelSection mapping (the first stage's model);
    `sharding`: a mesh preset name (dp, fsdp, tp, fsdp_tp) or a ShardingSection mapping, for every stage;
    `defaults`: trainer config keys every stage starts from; keyword arguments (single recipe): the
    stage's config sections, e.g. `train={"steps": 100}` or `**{"optim.lr": 1e-3}`.
    """

    def __init__(self, recipe: Optional[str] = None, model=None, sharding=None, *,
                 stages: Optional[Sequence] = None, run_dir: str = "runs/pipeline", defaults: Optional[Mapping] = None,
                 progress: bool = True, where: str = "Pipeline", stage_lines: Sequence[int] = (),
                 task: Optional[str] = None, **overrides):
        if task is not None:  # recipe's old name
            if recipe is not None:
                raise PosttrainError(f"{where}: task= is the old name of recipe=; give recipe= alone")
            _renamed_task(where)
            recipe = task
        if (recipe is None) == (stages is None):
            raise PosttrainError(f"{where}: give either recipe=... (one trainer) or stages=[...] (a chain), not "
                                 f"{'both' if recipe else 'neither'}")
        if recipe is not None:
            stages = [{"recipe": recipe, **_dotted(overrides)}]
            if not (stages[0].get("data") or {}).get("train"):  # the dataset comes with run(dataset)
                stages[0]["data"] = {**(stages[0].get("data") or {}), "train": FROM_RUN}
        elif overrides:
            raise PosttrainError(f"{where}: keyword config sections ({', '.join(overrides)}) are for recipe=...; "
                                 "with stages=[...] put them in a stage or in defaults")
        if not isinstance(stages, Sequence) or isinstance(stages, str) or not stages:
            raise PosttrainError(f"{where}: 'stages' must be a non-empty list of stages (mappings with a 'recipe')")
        self.run_dir, self.progress = run_dir, progress
        shared = _dotted(dict(defaults or {}))
        if sharding is not None:
            shared["sharding"] = {"preset": sharding} if isinstance(sharding, str) else dict(sharding)
        self.stages = self._build(stages, _model_spec(model, where), shared, where, list(stage_lines))

    @classmethod
    def from_yaml(cls, path: str, overrides: Sequence[str] = (), progress: bool = True) -> "Pipeline":
        """A pipeline file (keys run_dir, model, sharding, defaults, stages); `overrides` are dotted
        `key=value` strings: `run_dir=...`, `model.path=...`, or `STAGE.section.key=...` for a stage."""
        data = C.read_yaml(path, "pipeline file")  # a key given twice is an error naming its line
        with open(path, encoding="utf-8") as fh:
            root = yaml.compose(fh)  # the nodes: each stage's line, for error messages
        if not isinstance(data, dict):
            raise PosttrainError(f"{path}: the top level must be a mapping of keys ({', '.join(TOP_KEYS)})")
        for key in data:
            if key not in TOP_KEYS:
                raise C.unknown_key(str(path), "", key, TOP_KEYS)
        lines = []
        for k, v in root.value:  # the line of each stage, for error messages
            if k.value == "stages" and isinstance(v, yaml.SequenceNode):
                lines = [item.start_mark.line + 1 for item in v.value]
        base = os.path.dirname(os.path.abspath(path))
        stages = data.get("stages")
        if isinstance(stages, list):
            stages = [dict(s, config=os.path.join(base, s["config"])) if isinstance(s, dict) and
                      isinstance(s.get("config"), str) else s for s in stages]
        data["stages"] = stages
        _apply_overrides(data, overrides)
        return cls(model=data.get("model"), sharding=data.get("sharding"), stages=data["stages"],
                   run_dir=data.get("run_dir") or "runs/pipeline", defaults=data.get("defaults"),
                   progress=progress, where=str(path), stage_lines=lines)

    def _build(self, stages, model: dict, shared: dict, where: str, lines: list) -> list[Stage]:
        out: list[Stage] = []
        hf: dict[str, str] = {}  # stage name -> its HF folder
        policy = model  # the model the next stage starts from
        for i, raw in enumerate(stages):
            at = f"{where}:{lines[i]}" if i < len(lines) else where
            if not isinstance(raw, Mapping):
                raise PosttrainError(f"{at}: stages[{i}] must be a mapping with a 'recipe', got {raw!r}")
            recipe = raw.get("recipe")
            if "task" in raw:  # recipe's old name
                if recipe is not None:
                    raise PosttrainError(f"{at}: stages[{i}] sets 'task', the old name of 'recipe', and 'recipe'; "
                                         "keep 'recipe'")
                _renamed_task(at)
                recipe = raw["task"]
            if recipe not in TRAINERS:
                close = difflib.get_close_matches(str(recipe), list(TRAINERS), n=1)
                raise PosttrainError(f"{at}: stages[{i}].recipe must be one of {', '.join(TRAINERS)}, got {recipe!r}"
                                     + (f" (did you mean '{close[0]}'?)" if close else ""))
            name = raw.get("name") or recipe
            if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
                raise PosttrainError(f"{at}: stages[{i}].name must be a plain name (letters, digits, - or _), "
                                     f"got {name!r}")
            if name in hf:
                raise PosttrainError(f"{at}: two stages are named {name!r}; give each a different 'name'")
            at = f"{at} (stage '{name}')"
            file_cfg = _merge(_read_yaml(raw["config"], at) if raw.get("config") else {}, shared)
            own = {k: v for k, v in raw.items() if k not in STAGE_KEYS}
            own_model = _model_spec(own.pop("model", None), at)
            cfg = _merge(file_cfg, own)
            cfg["model"] = _chain_model(file_cfg.get("model") or {}, own_model, None if recipe == "distill" else policy,
                                        at, "the student as the stage's 'model'" if recipe == "distill" else
                                        "the pipeline's 'model'" if not out else "")
            if recipe == "distill" and policy and "teacher" not in own:  # the previous model teaches
                cfg["teacher"] = _chain_model(file_cfg.get("teacher") or {}, {}, policy, at, "")
            cfg = _substitute(cfg, hf, at)
            if "run_dir" in cfg:
                raise PosttrainError(f"{at}: 'run_dir' is set by the pipeline ({self.run_dir}/{name}); "
                                     "set the pipeline's run_dir instead")
            cfg["run_dir"] = os.path.join(self.run_dir, name)
            cfg_cls = recipe_class(recipe).config_class
            out.append(Stage(name, recipe, C.from_dict(cfg_cls, cfg, where=at), at))
            hf[name] = out[-1].hf
            if recipe != "rm":
                policy = {"path": out[-1].hf}
        return out

    def run(self, dataset=None) -> dict:
        """Run (or resume) every stage; `dataset` (a file path or a list of row dicts) is the first stage's
        `data.train`. Returns {"stages": [{name, recipe, run_dir, hf, result}], "run_dir"}."""
        import jax
        from jax.experimental import multihost_utils

        from posttrain.recipes.lifecycle import check_same_run
        from posttrain.runs import export_run
        from posttrain.sharding import is_main_process

        if dataset is not None:
            self._set_dataset(dataset)
        elif self.stages[0].config.data.train == FROM_RUN:
            raise PosttrainError("Pipeline.run: no dataset; give it as run(dataset) (a file or a list of rows) "
                                 "or as data={'train': FILE}")
        for stage in self.stages:  # every folder checked before anything runs
            if stage.config.checkpoint.resume:
                check_same_run(stage.config)
        summary, ids = [], {}
        for stage in self.stages:
            record = stage.done(dict(ids)) if stage.config.checkpoint.resume else None
            if record is not None:
                _print(f"[pipeline] stage {stage.name} ({stage.recipe}) already done: {stage.hf}")
            else:
                started = os.path.join(stage.run_dir, "stage_inputs.json")
                if stage.config.checkpoint.resume and os.path.isfile(started):  # resuming: from the same inputs?
                    with open(started) as fh:
                        stage.check_inputs(json.load(fh), ids)
                trainer_cls = recipe_class(stage.recipe)
                _print(f"[pipeline] stage {stage.name} ({stage.recipe}) -> {stage.run_dir}")
                trainer = trainer_cls(stage.config, progress=self.progress)  # checks everything, writes nothing
                if is_main_process():
                    os.makedirs(stage.run_dir, exist_ok=True)
                    _write_json(started, ids)
                result = _plain(trainer.train())
                record = {"name": stage.name, "recipe": stage.recipe, "id": uuid.uuid4().hex, "inputs": dict(ids),
                          "result": result}
                if is_main_process():  # export, then mark done: a kill in between exports again
                    shutil.rmtree(stage.hf, ignore_errors=True)
                    export_run(stage.run_dir, stage.hf)
                    _write_json(os.path.join(stage.run_dir, DONE), record)
                if jax.process_count() > 1:
                    multihost_utils.sync_global_devices(f"posttrain:pipeline {stage.name} exported")
                    record = _read_json(os.path.join(stage.run_dir, DONE))  # process 0's id
            ids[stage.name] = record["id"]
            summary.append({"name": stage.name, "recipe": stage.recipe, "run_dir": stage.run_dir, "hf": stage.hf,
                            "result": record["result"]})
        return {"run_dir": self.run_dir, "stages": summary}

    def _set_dataset(self, dataset) -> None:
        first = self.stages[0]
        if not isinstance(dataset, (str, os.PathLike)):
            if not isinstance(dataset, Sequence) or not all(isinstance(r, Mapping) for r in dataset):
                raise PosttrainError("Pipeline.run: dataset must be a file path or a list of row dicts")
            path = os.path.join(self.run_dir, "data", f"{first.name}.jsonl")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as fh:
                fh.writelines(json.dumps(dict(r)) + "\n" for r in dataset)
            dataset = path
        cfg_cls = recipe_class(first.recipe).config_class
        data = C.to_dict(first.config)
        data["data"]["train"] = os.fspath(dataset)
        first.config = C.from_dict(cfg_cls, data, where=first.where)


def _apply_overrides(data: dict, overrides: Sequence[str]) -> None:
    """Dotted `key=value` overrides of a pipeline file (in place): top-level keys, or STAGE.key...=value."""
    names = {}
    for s in data.get("stages") or []:
        if isinstance(s, dict):
            names[s.get("name") or s.get("recipe") or s.get("task")] = s
    for item in overrides:
        dotted, value = C.parse_override(item, example="sft.train.steps=100")
        head, *rest = dotted.split(".")
        if head in names and rest:
            node = names[head]
        elif head in TOP_KEYS and head != "stages":
            node, rest = data, [head, *rest]
        else:
            raise C.unknown_key("command line", "", head, [k for k in TOP_KEYS if k != "stages"] + list(names))
        for p in rest[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {} if node.get(p) is None else node[p]
                if not isinstance(node[p], dict):
                    raise PosttrainError(f"command line: cannot set '{dotted}': '{p}' is a value, not a section")
            node = node[p]
        node[rest[-1]] = value


def _read_yaml(path: str, where: str) -> dict:
    try:
        data = C.read_yaml(path, "its config file") or {}
    except PosttrainError as e:
        raise PosttrainError(f"{where}: {e}") from None
    if not isinstance(data, dict):
        raise PosttrainError(f"{where}: {path} must hold a mapping of config keys")
    data.pop("run_dir", None)  # the pipeline places every stage
    return data


def _plain(result: Mapping) -> dict[str, Any]:
    """A trainer's result as JSON-able numbers."""
    out = {}
    for k, v in result.items():
        if hasattr(v, "item"):  # numpy / jax scalars
            v = v.item() if getattr(v, "size", 1) == 1 else None
        if isinstance(v, (bool, int, float, str)):
            out[k] = v
    return out


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2)
    os.replace(tmp, path)


def _read_json(path: str):
    with open(path) as fh:
        return json.load(fh)


def _print(*args) -> None:
    from posttrain.sharding import is_main_process

    if is_main_process():
        print(*args)

"""JSON Schemas of the run configs (`posttrain schema`), so editors check YAML files as they are typed.

What it is: `json_schema(cls)` turns a config dataclass into a JSON Schema (draft 2020-12) with
the same rules `config.from_dict` applies (types, Literal choices, no unknown keys, required
keys) and each field's comment in the source as its description; `pipeline_schema()` is the
schema of a `posttrain run` file (each stage: `task`, `name`, `config` and that trainer's keys);
`write_schemas(out)` writes one file per trainer plus `pipeline.schema.json`. With the YAML
language server (VS Code's YAML extension) a first line `# yaml-language-server: $schema=PATH`
in a config file turns it on.

What it is not: the validator posttrain runs (that is `config.from_dict`, which also checks the
invariants in `__post_init__`, e.g. exactly one of model.path and model.preset).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import typing
from typing import Literal

from posttrain import config as C

_COMMENT = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+)$")


def _descriptions(cls) -> dict[str, str]:
    """field name -> its trailing comment in the class source."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    return {m.group(1): m.group(2).strip() for m in map(_COMMENT.match, src.splitlines()) if m}


def _schema(tp) -> dict:
    if (inner := C._optional_arg(tp)) is not None:
        return {"anyOf": [_schema(inner), {"type": "null"}]}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return json_schema(tp)
    if origin is Literal:
        return {"enum": list(args)}
    if origin is tuple:
        return {"type": "array", "items": _schema(args[0])}
    if origin is dict:
        if args[0] is int:  # layer maps; YAML keys `0: 3`
            return {"type": "object", "patternProperties": {"^-?[0-9]+$": _schema(args[1])},
                    "additionalProperties": False}
        return {"type": "object", "additionalProperties": _schema(args[1])}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if tp in simple:
        return {"type": simple[tp]}
    raise TypeError(f"no JSON Schema for config field type {tp!r}")


def json_schema(cls) -> dict:
    """The JSON Schema of config dataclass `cls` (nested sections inline)."""
    hints, notes = typing.get_type_hints(cls), _descriptions(cls)
    props, required = {}, []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        s = _schema(hints[f.name])
        if f.name in notes:
            s["description"] = notes[f.name]
        if f.default is not dataclasses.MISSING:
            s["default"] = C.to_dict(f.default)
        elif f.default_factory is dataclasses.MISSING:
            required.append(f.name)
        props[f.name] = s
    out = {"type": "object", "properties": props, "additionalProperties": False}
    doc = (cls.__doc__ or "").strip().splitlines()
    if doc and not doc[0].startswith(cls.__name__ + "("):  # dataclasses' generated signature is no help
        out["title"] = doc[0]
    if required:
        out["required"] = required
    return out


def trainer_schema(task: str) -> dict:
    from posttrain.trainers import trainer_classes

    cfg_cls, _ = trainer_classes(task)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": f"posttrain {task} config",
            **json_schema(cfg_cls)}


def pipeline_schema() -> dict:
    """A `posttrain run` file: run_dir, model, sharding, defaults and stages (one trainer config each)."""
    from posttrain.trainers import TRAINERS, trainer_classes

    stages = []
    for task in TRAINERS:
        s = _partial(json_schema(trainer_classes(task)[0]))  # the rest may come from `config:` or defaults
        props = {k: v for k, v in s["properties"].items() if k != "run_dir"}  # the pipeline places stages
        props["model"] = {"anyOf": [{"type": "string"}, props["model"]]}  # a folder or a preset name
        props.update(task={"const": task}, name={"type": "string", "pattern": "^[A-Za-z0-9_-]+$"},
                     config={"type": "string", "description": "a trainer config file, under the stage's keys"})
        stages.append({"type": "object", "properties": props, "required": ["task"], "additionalProperties": False})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "title": "posttrain pipeline (posttrain run)",
        "type": "object", "additionalProperties": False, "required": ["stages"],
        "properties": {
            "run_dir": {"type": "string", "description": "each stage runs in <run_dir>/<stage name>"},
            "model": {"anyOf": [{"type": "string"}, json_schema(C.ModelSection)],
                      "description": "the first stage's model: a Hugging Face folder, a preset or a section"},
            "sharding": {"anyOf": [{"type": "string"}, json_schema(C.ShardingSection)]},
            "defaults": {"type": "object", "description": "config keys every stage starts from"},
            "stages": {"type": "array", "minItems": 1, "items": {"oneOf": stages}},
        }}


def _partial(schema):
    """`schema` without required keys, at every depth."""
    if isinstance(schema, dict):
        return {k: _partial(v) for k, v in schema.items() if k != "required"}
    if isinstance(schema, list):
        return [_partial(v) for v in schema]
    return schema


def write_schemas(out_dir: str) -> list[str]:
    """`<task>.schema.json` for every trainer and `pipeline.schema.json` in `out_dir`; the paths."""
    from posttrain.trainers import TRAINERS

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, schema in [*((t, trainer_schema(t)) for t in TRAINERS), ("pipeline", pipeline_schema())]:
        paths.append(os.path.join(out_dir, f"{name}.schema.json"))
        with open(paths[-1], "w") as fh:
            json.dump(schema, fh, indent=1)
    return paths

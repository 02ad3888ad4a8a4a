"""JSON Schemas of the run configs (`posttrain schema`), so editors check YAML files as they are typed.

What it is: `json_schema(cls)` is pydantic's JSON Schema (draft 2020-12) of a config dataclass,
the model `config.from_dict` validates with (types, Literal choices, required keys), plus what
pydantic does not know: no unknown keys, each field's comment in the source (at the end of its
line, or the lines right above it) as its description, and nested sections inline; the bounds of
numeric fields (`config.Positive`, ... : minimum, exclusiveMinimum, ...) come from pydantic;
`pipeline_schema()` is the schema of a `posttrain run` file (each stage: `recipe`, `name`, `config` and
that trainer's keys); `write_schemas(out)` writes one file per
trainer plus `pipeline.schema.json`. With the YAML language server (VS Code's YAML extension) a
first line `# yaml-language-server: $schema=PATH` in a config file turns it on.

What it is not: the validator posttrain runs (that is `config.from_dict`, which also checks the
invariants between fields in `__post_init__`, e.g. exactly one of model.path and model.preset).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import os
import re
import tokenize

import pydantic
from pydantic.json_schema import GenerateJsonSchema

from posttrain import config as C

_FIELD = re.compile(r"^(\s+)(\w+)\s*:")


def _descriptions(cls) -> dict[str, str]:
    """field name -> its comment in the source of the class that declares it (a base class for inherited
    fields): the comment at the end of its line, else the comment lines right above it."""
    out = {}
    for klass in reversed(getattr(cls, "__mro__", (cls,))):
        if dataclasses.is_dataclass(klass):
            out.update(_own_descriptions(klass))
    return out


def _own_descriptions(cls) -> dict[str, str]:
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    out, above = {}, []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped[1:].strip())
            continue
        m = _FIELD.match(line)
        if m and m.group(2) in names:
            trailing = _trailing_comment(line)
            note = trailing or " ".join(above)
            if note:
                out[m.group(2)] = note
        above = []
    return out


def _trailing_comment(line: str) -> str:
    """The `# ...` comment ending a line of code (not a # inside a string), or ''."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return ""
    return next((t.string[1:].strip() for t in tokens if t.type == tokenize.COMMENT), "")


class _Generator(GenerateJsonSchema):
    """pydantic's generator (its public hooks), told what `config.from_dict` adds."""

    def dataclass_schema(self, schema):
        out = super().dataclass_schema(schema)
        out["additionalProperties"] = False  # unknown keys are errors
        for name, note in _descriptions(schema["cls"]).items():
            if name in out["properties"]:
                out["properties"][name]["description"] = note
        return out

    def dict_schema(self, schema):
        out = super().dict_schema(schema)
        if schema.get("keys_schema", {}).get("type") == "int":  # layer maps; YAML keys `0: 3`
            out["propertyNames"] = {"pattern": "^-?[0-9]+$"}
        return out

    def field_title_should_be_set(self, schema) -> bool:
        return False  # a title "Max Length" for the key max_length adds nothing


def json_schema(cls) -> dict:
    """The JSON Schema of config dataclass `cls` (nested sections inline: editors show their keys in place)."""
    schema = pydantic.TypeAdapter(cls).json_schema(schema_generator=_Generator)
    return _inline(schema, schema.pop("$defs", {}))


def _inline(node, defs: dict):
    """`node` with every {"$ref": "#/$defs/NAME", ...} replaced by that definition (and its other keys)."""
    if isinstance(node, dict):
        if "$ref" in node:
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return {**_inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs), **_inline(rest, defs)}
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def trainer_schema(recipe: str) -> dict:
    from posttrain.trainers import recipe_class

    cfg_cls = recipe_class(recipe).config_class
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **json_schema(cfg_cls),
            "title": f"posttrain {recipe} config"}


def pipeline_schema() -> dict:
    """A `posttrain run` file: run_dir, model, sharding, defaults and stages (one trainer config each)."""
    from posttrain.trainers import TRAINERS, recipe_class

    stages = []
    for recipe in TRAINERS:
        s = _partial(json_schema(recipe_class(recipe).config_class))  # the rest may come from `config:` or defaults
        props = {k: v for k, v in s["properties"].items() if k != "run_dir"}  # the pipeline places stages
        props["model"] = {"anyOf": [{"type": "string"}, props["model"]]}  # a folder or a preset name
        props.update(recipe={"const": recipe, "description": "the stage's trainer"},
                     task={"const": recipe, "deprecated": True, "description": "the old name of recipe"},
                     name={"type": "string", "pattern": "^[A-Za-z0-9_-]+$"},
                     config={"type": "string", "description": "a trainer config file, under the stage's keys"})
        stages.append({"type": "object", "properties": props, "additionalProperties": False,
                       "oneOf": [{"required": ["recipe"]}, {"required": ["task"]}]})
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
    """`<recipe>.schema.json` for every trainer and `pipeline.schema.json` in `out_dir`; the paths."""
    from posttrain.trainers import TRAINERS

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, schema in [*((t, trainer_schema(t)) for t in TRAINERS), ("pipeline", pipeline_schema())]:
        paths.append(os.path.join(out_dir, f"{name}.schema.json"))
        with open(paths[-1], "w") as fh:
            json.dump(schema, fh, indent=1)
    return paths

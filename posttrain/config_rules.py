"""The config loading rules: YAML file + dotted command-line overrides -> frozen dataclasses, and bounds.

What it is: `from_dict` / `load` validate nested dicts into frozen, keyword-only dataclasses with
pydantic v2 in strict mode (no "10" for an int, no 1 or "true" for a bool, no unknown keys) and turn
pydantic's errors into messages naming the dotted key (did you mean ..., the expected type, the bound,
where the value came from); `to_dict` / `save` go back; `read_yaml` reads a file (a key given twice, a
syntax error, a missing file: one message naming it), `parse_override` one `key=value`. Bounds of
numeric fields are typing metadata (`Positive`, `AtLeast1`, `Rate`, ...): pydantic checks them on load,
the JSON Schema shows them, and `Section.__post_init__` checks them when a section is built in Python;
`Section.aliases` reads a renamed key by its old name with a FutureWarning.

What it is not: the sections themselves (`posttrain.config`, which re-exports what users call here).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, ClassVar, Literal, TypeVar

import yaml
from annotated_types import Ge, Gt, Interval, Le, Lt

from posttrain.errors import PosttrainError

T = TypeVar("T")

# Bounds of numeric fields, as typing metadata: pydantic checks them when a config is loaded, the JSON
# Schema shows them (`posttrain schema`: minimum / exclusiveMinimum ...), and `Section.__post_init__`
# checks them when a section is built in Python. One message for both: "<key>.<field> must be > 0, got 0".
Positive = Annotated[float, Gt(0)]  # > 0
NonNegative = Annotated[float, Ge(0)]  # >= 0
AtLeast1 = Annotated[int, Ge(1)]  # a count of at least one
Count = Annotated[int, Ge(0)]  # a count, 0 allowed (often "off")
Probability = Annotated[float, Interval(ge=0, le=1)]  # in [0, 1]
Rate = Annotated[float, Interval(ge=0, lt=1)]  # in [0, 1)
Seed = Annotated[int, Interval(ge=0, lt=2**32)]  # a PRNG / shuffle seed


def _limits(metadata) -> dict:
    """{"gt"/"ge"/"lt"/"le": bound} of a field's annotated_types metadata."""
    out = {}
    for m in metadata:
        for name in ("gt", "ge", "lt", "le"):
            if getattr(m, name, None) is not None and isinstance(m, (Gt, Ge, Lt, Le, Interval)):
                out[name] = getattr(m, name)
    return out


def bound_text(limits: dict) -> str:
    """'> 0', '>= 1', 'in [0, 1)', ... for `_limits`' dict."""
    show = lambda v: "2**32" if v == 2**32 else repr(v)  # noqa: E731
    lo = ("(", limits["gt"]) if "gt" in limits else ("[", limits["ge"]) if "ge" in limits else None
    hi = (")", limits["lt"]) if "lt" in limits else ("]", limits["le"]) if "le" in limits else None
    if lo and hi:
        return f"in {lo[0]}{show(lo[1])}, {show(hi[1])}{hi[0]}"
    if lo:
        return f"{'>' if lo[0] == '(' else '>='} {show(lo[1])}"
    return f"{'<' if hi[0] == ')' else '<='} {show(hi[1])}"


def _within(limits: dict, v) -> bool:
    ok = [v > limits["gt"] if "gt" in limits else True, v >= limits["ge"] if "ge" in limits else True,
          v < limits["lt"] if "lt" in limits else True, v <= limits["le"] if "le" in limits else True]
    return all(ok)  # NaN compares false: out of every bound


@functools.cache
def _hints(cls) -> dict:
    """The field types of `cls` with their metadata (resolved once per class: sections are built often)."""
    return typing.get_type_hints(cls, include_extras=True)


def field_limits(cls, name: str) -> tuple[dict, bool]:
    """(limits, optional) of field `name` of config dataclass `cls` (empty limits: unbounded)."""
    hint = _hints(cls)[name]
    inner = _optional_arg(hint)
    optional, hint = inner is not None, inner if inner is not None else hint
    return (_limits(hint.__metadata__) if typing.get_origin(hint) is Annotated else {}), optional


class Section:
    """Base of the config sections: `__post_init__` checks every bounded field (see `Positive`, ...);
    `key` is the section's name in a config file (errors say `<key>.<field>`); `aliases` maps a renamed
    key's old name to its new one (read, with a FutureWarning, until the next release)."""

    key: ClassVar[str] = ""
    aliases: ClassVar[dict[str, str]] = {}

    def __post_init__(self):
        for f in dataclasses.fields(self):
            limits, optional = field_limits(type(self), f.name)
            value = getattr(self, f.name)
            if limits and not (value is None and optional) and not _within(limits, value):
                raise PosttrainError(f"{self.key}.{f.name} must be {bound_text(limits)}"
                                     f"{' or null' if optional else ''}, got {value}")

# ----------------------------------------------------------------------------- loading rules (pydantic)


@functools.cache
def _adapter(tp):
    import pydantic  # imported on first use: `import posttrain` does not pay for it

    return pydantic.TypeAdapter(tp)  # built once per type (a build takes milliseconds)


def _validate(tp, value, where: str, key: str = ""):
    """`value` (the one under dotted `key`) checked against type `tp` and built: sections become
    dataclasses, lists tuples. Errors are PosttrainErrors that start with `where`."""
    import pydantic

    # pydantic's strict mode on JSON input is the YAML rule set: mappings for sections, lists for
    # tuples, ints for floats, but no "10" for an int and no 0 / 1 for a bool. (On Python input, strict
    # mode wants dataclass instances where YAML gives dicts; pydantic's advice is this JSON round trip.)
    data = json.loads(json.dumps(to_dict(value), default=str))  # a copy (YAML dates as text) to edit below
    _renamed(tp, data, where, key)
    while True:
        try:
            return _adapter(tp).validate_json(json.dumps(data), strict=True, extra="forbid")
        except pydantic.ValidationError as e:
            errors = e.errors(include_url=False)
        except PosttrainError as e:  # an invariant in __post_init__: add which file/source it came from
            raise PosttrainError(f"{where}: {e}") from None
        eased = [(err["loc"], new) for err in errors if (new := _eased(tp, err)) is not None]
        if not eased:
            raise _error(tp, errors, data, where, key)
        for loc, new in eased:  # retry with the YAML habits strict mode refuses eased
            if loc:
                _at(data, loc[:-1])[loc[-1]] = new
            else:
                data = new


def _renamed(tp, data, where: str, key: str = "") -> None:
    """Renamed keys (a section's `aliases`) given by their old names: moved to the new ones in place, each
    with a FutureWarning; both names at once is an error. Recurses into the sections."""
    tp = _optional_arg(tp) or tp
    if not (dataclasses.is_dataclass(tp) and isinstance(data, dict)):
        return
    for old, new in getattr(tp, "aliases", {}).items():
        if old in data:
            dotted = f"{key}.{old}" if key else old
            if new in data:
                raise PosttrainError(f"{where}: '{dotted}' is the old name of '{new}', which is set too; keep '{new}'")
            _warn_renamed(where, dotted, new)
            data[new] = data.pop(old)
    hints = typing.get_type_hints(tp)
    for name, sub in data.items():
        if name in hints:
            _renamed(hints[name], sub, where, f"{key}.{name}" if key else name)


def _warn_renamed(where: str, dotted: str, new: str) -> None:
    import warnings

    warnings.warn(f"{where}: '{dotted}' is now called '{new}'; the old name is read until the next release",
                  FutureWarning, stacklevel=4)


def _eased(tp, err):
    """The value to retry with where `err` is a YAML habit that strict mode refuses; else None."""
    kind, value = err["type"], err["input"]
    if kind == "float_type" and isinstance(value, str):
        # PyYAML implements YAML 1.1, which reads `3e-4` and `1e5` (no dot) as strings; numbers
        # written that way are common for learning rates, so accept strings that parse as floats.
        try:
            return float(value)
        except ValueError:
            return None
    if kind == "dataclass_type" and value is None:  # an empty YAML section (`lora:` and nothing under it)
        return {}
    if kind == "missing" and dataclasses.is_dataclass(_walk(tp, err["loc"])[1]):
        return {}  # a missing required section: built empty, the error names the leaf needed ('data.train')
    return None


def _at(data, loc):
    return functools.reduce(lambda node, part: node[part], loc, data)


def _walk(tp, loc, key: str = "") -> tuple[str, object]:
    """(dotted key, field type) of the value at pydantic error location `loc` in a `tp` value at `key`."""
    for part in loc:
        tp = _optional_arg(tp) or tp
        if dataclasses.is_dataclass(tp):
            tp, key = typing.get_type_hints(tp)[part], f"{key}.{part}" if key else part
        elif typing.get_origin(tp) is tuple:
            tp, key = typing.get_args(tp)[0], f"{key}[{part}]"
        else:  # dict[str, X] / dict[int, X]
            tp, key = typing.get_args(tp)[1], f"{key}.{part}" if key else str(part)
    return key, _optional_arg(tp) or tp


def _error(tp, errors: list[dict], data, where: str, key: str) -> PosttrainError:
    """One message for pydantic's `errors`: unknown keys first (a typo in a required key then gets
    "did you mean" rather than "missing"), then missing keys, then the first wrong value."""
    for err in errors:
        if err["type"] == "unexpected_keyword_argument":
            section, section_tp = _walk(tp, err["loc"][:-1], key)
            return unknown_key(where, f"{section}." if section else "", err["loc"][-1], _field_names(section_tp))
    missing = [_walk(tp, err["loc"], key)[0] for err in errors if err["type"] == "missing"]
    if missing:
        keys = ", ".join(f"'{k}'" for k in missing)
        return PosttrainError(f"{where}: missing required key {keys} (set it in the YAML file or on the "
                              f"command line as {missing[0]}=...)")
    if "error" in errors[0].get("ctx", {}):  # a ValueError / assert in a __post_init__: its own words
        return PosttrainError(f"{where}: {errors[0]['ctx']['error']}")
    loc = errors[0]["loc"]
    if errors[0]["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        dotted, _ = _walk(tp, loc, key)  # a bound of the field's type: the message Section gives
        parent = _walk(tp, loc[:-1], key)[1]
        limits, optional = field_limits(parent, loc[-1])
        return PosttrainError(f"{where}: {dotted} must be {bound_text(limits)}{' or null' if optional else ''}, "
                              f"got {_at(data, loc)}")
    if "[key]" in loc:  # a mapping key of the wrong type (pydantic's location: KEY, '[key]'): blame the mapping
        loc = loc[:loc.index("[key]") - 1]
    dotted, expected = _walk(tp, loc, key)
    value = _at(data, loc)
    if dataclasses.is_dataclass(expected):
        scope = f"'{dotted}'" if dotted else "the top level"
        return PosttrainError(f"{where}: {scope} must be a mapping of keys ({', '.join(_field_names(expected))}), "
                              f"got {value!r} ({type(value).__name__})")
    hint = {bool: "; write true or false without quotes", str: "; quote it to pass it as text"}.get(expected, "")
    if typing.get_origin(expected) is tuple:  # a bare string is refused, not split into characters
        hint = "; write a list, e.g. [a, b]"
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return PosttrainError(f"{where}: '{dotted}' must be {_describe(expected)}, got {shown} "
                          f"({type(value).__name__}){hint}")


def unknown_key(where: str, prefix: str, key: str, known: Sequence[str]) -> PosttrainError:
    """The error for an unknown key: where, the dotted key, the known keys at that level, did you mean ..."""
    dotted = f"{prefix}{key}"
    scope = f"under {prefix[:-1]}" if prefix else "at the top level"
    msg = f"{where}: unknown key '{dotted}' (known keys {scope}: {', '.join(known)}"
    close = difflib.get_close_matches(str(key), known, n=1)
    return PosttrainError(msg + (f"; did you mean '{close[0]}'?)" if close else ")"))


def _optional_arg(tp) -> object | None:
    """X for Optional[X] / X | None, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else None
    return None


def _describe(tp) -> str:
    """Human-readable expected type for error messages."""
    if (inner := _optional_arg(tp)) is not None:
        return f"{_describe(inner)} or null"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"a list of {_describe(args[0])}"
    if origin is dict:
        return f"a mapping of {_describe(args[0])} to {_describe(args[1])}"
    return {bool: "bool (true or false)", int: "int", float: "float", str: "str"}.get(tp, str(tp))


def _field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def from_dict(cls: type[T], data: Mapping, where: str = "config") -> T:
    """Build dataclass `cls` from a nested dict, checking keys and types; `where` prefixes errors."""
    return _validate(cls, data, where)


def parse_override(item: str, example: str = "optim.lr=1e-5") -> tuple[str, object]:
    """(dotted key, value) of one command-line `key=value` (the value read as YAML: numbers, lists, null)."""
    where = "command line"
    if "=" not in item:
        raise PosttrainError(f"{where}: override {item!r} has no '='; expected the form key=value, "
                             f"e.g. {example}")
    dotted, raw = (s.strip() for s in item.split("=", 1))
    try:
        return dotted, yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e)
        raise PosttrainError(f"{where}: cannot parse the value of {item!r} as YAML ({problem}); quote "
                             f"strings that contain YAML syntax, e.g. key='a: b'") from None


def _apply_override(cls, data: dict, item: str) -> None:
    """Set one `a.b.c=value` override in `data` (in place), validating the key path against `cls`."""
    where = "command line"
    dotted, value = parse_override(item)
    parts, node, tp, prefix = dotted.split("."), data, cls, ""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if typing.get_origin(tp) is dict:
            # A free-form mapping field: the next part is a mapping key and must be the last one.
            if not last:
                raise PosttrainError(f"{where}: '{dotted}' goes too deep: '{prefix[:-1]}' maps names "
                                     f"to values, so set {prefix}{part}=...")
            tp = typing.get_args(tp)[1]
        else:
            names = _field_names(tp)
            if part not in names and part in getattr(tp, "aliases", {}):  # a renamed key, by its old name
                _warn_renamed(where, f"{prefix}{part}", tp.aliases[part])
                part = tp.aliases[part]
            if part not in names:
                raise unknown_key(where, prefix, part, names)
            tp = typing.get_type_hints(tp)[part]
        if last:
            # Type-check now so a bad value is blamed on the command line, not on the YAML file.
            _validate(tp, value, where, dotted)
            node[part] = value
            return
        tp = _optional_arg(tp) or tp  # descend through Optional[Section]
        if not (dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict):
            raise PosttrainError(f"{where}: '{prefix}{part}' is a value, not a section, so '{dotted}' "
                                 f"is not a key; use {prefix}{part}=...")
        if node.get(part) is None:
            node[part] = {}
        elif not isinstance(node[part], dict):
            raise PosttrainError(f"{where}: cannot set '{dotted}': '{prefix}{part}' in the config file is "
                                 f"{node[part]!r}, not a section")
        node, prefix = node[part], f"{prefix}{part}."


class UniqueKeySafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last one,
    so the first setting would be ignored without a word): a `DuplicateKeyError` naming the key and both
    lines."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merge keys may repeat
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKeyError(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: SafeLoader reports it
                    continue
        return super().construct_mapping(node, deep=deep)


class DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key, first: int, line: int):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.first, self.line = key, first, line


def load_yaml(stream, path) -> object:
    """yaml.safe_load with duplicate keys refused: PosttrainError 'PATH:LINE: duplicate key ...'."""
    try:
        return yaml.load(stream, Loader=UniqueKeySafeLoader)  # noqa: S506  (a SafeLoader subclass)
    except DuplicateKeyError as e:
        raise PosttrainError(f"{path}:{e.line}: duplicate key {e.key!r} (first set on line {e.first}); YAML would "
                             "silently keep only the last one: delete one of them, or merge them") from None


def _decode_error(path, e: UnicodeDecodeError) -> PosttrainError:
    return PosttrainError(f"{path}: the file is not UTF-8 text (byte {e.start + 1}: {e.object[e.start:e.start + 1]!r}, "
                          f"{e.reason}); re-save it as UTF-8")


def read_yaml(path: str | os.PathLike, what: str = "config file"):
    """The YAML document in file `path` (None when empty); a missing or unreadable file, one not in UTF-8,
    a syntax error or a key given twice is a PosttrainError naming the file (and the line)."""
    try:
        with open(path, encoding="utf-8") as f:
            return load_yaml(f, path)
    except OSError as e:  # missing file, a folder, no permission
        raise PosttrainError(f"cannot read {what} {path}: {e.strerror} (check the path)") from None
    except UnicodeDecodeError as e:  # UTF-16, Latin-1, ...
        raise _decode_error(path, e) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise PosttrainError(f"{loc}: YAML syntax error: {problem} (fix the file at that line)") from None


def load(cls: type[T], path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> T:
    """Read YAML `path` (None: start empty), apply dotted `key=value` overrides, build `cls`.
    A key given twice in one mapping of the file is an error naming it and its line."""
    data: dict = {}
    if path is not None:
        data = read_yaml(path)
        data = {} if data is None else data  # an empty file is an empty config
        if not isinstance(data, dict):
            raise PosttrainError(f"{path}: the top level must be a mapping of keys "
                                 f"({', '.join(_field_names(cls))}), got {type(data).__name__}")
    for item in overrides:
        _apply_override(cls, data, item)
    return from_dict(cls, data, where=str(path) if path is not None else "command line")


def to_dict(obj) -> dict:
    """Inverse of `from_dict`: a dataclass becomes plain dicts, lists and scalars (YAML/JSON safe)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj  # scalars: recursion bottoms out here


def save(obj, path: str | os.PathLike) -> None:
    """Write `obj` as YAML (field order kept), creating the parent folder; `load` reads it back."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(to_dict(obj), f, sort_keys=False)

"""Judging model-written code against a row's tests, with the tests and every comparison on the trainer's side.

What it is: `run_tests(sandbox, code, tests) -> bool`. The program runs in `posttrain.sandbox` behind the harness
`_code_harness.py`, which answers calls and nothing else; the tests (Python: statements and `assert`s, as datasets
such as MBPP / HumanEval ship them) run here, in a namespace of their own with the interpreter's builtins, where
each name the tests use but do not define (the function under test, `x` of "x = ...") is asked of the program.
What comes back is plain data (None, bool, int, float, str, bytes, list, tuple, set, dict, decoded here into fresh
objects), or a handle (`_Remote`) to a function, class or instance of the program that can only be called or have
attributes read (through the channel again): a handle cannot be compared, hashed, iterated or tested for truth.
So expected values never enter the sandbox, the program's objects never reach a comparison, and nothing the
program prints, writes or exits with counts: only whether the tests, run here, finish without an exception.
A program's exception is raised here as the builtin exception of the same name (tests that expect a ValueError
see one); a program that stops answering (exit, crash, time or memory limit) or answers what is not plain data
in the agreed encoding raises `_Lost`, a BaseException the tests cannot catch with `except Exception`.

What it is not: a sandbox for the tests. They run in this process with its rights, like a config's reward
function: a row's tests are trusted code of the data set (docs/security.md). Every failure while judging one
sample, whatever it is, is that sample's 0 (logged), never an exception that reaches the reward's batch.
"""

from __future__ import annotations

import ast
import builtins
import logging
import os
from typing import Optional

from posttrain.sandbox import Sandbox

log = logging.getLogger(__name__)
_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_code_harness.py")
_BUILTINS = frozenset(n for n in dir(builtins) if not n.startswith("_"))
_EXCEPTIONS = {n: getattr(builtins, n) for n in dir(builtins)
               if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), Exception)}


class _Lost(BaseException):
    """The program did not answer, or answered what is not plain data: its tests cannot pass."""


def _encode(v, depth=0):
    """Plain data of the tests as JSON (the harness's encoding); a handle as its reference. TypeError otherwise."""
    if depth > 50:
        raise ValueError("value too deep")
    t = type(v)
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return v if v == v and v not in (float("inf"), float("-inf")) else {"$float": repr(v)}
    if t is bytes:
        return {"$bytes": v.hex()}
    if t is list:
        return [_encode(x, depth + 1) for x in v]
    if t is tuple:
        return {"$tuple": [_encode(x, depth + 1) for x in v]}
    if t in (set, frozenset):
        return {"$set": [_encode(x, depth + 1) for x in v]}
    if t is dict:
        return {"$dict": [[_encode(k, depth + 1), _encode(x, depth + 1)] for k, x in v.items()]}
    if t is _Remote:
        return {"$ref": object.__getattribute__(v, "_ref")}
    raise TypeError(f"code_tests: a {t.__name__} cannot be passed to the program (plain data only)")


def _decode(e):
    """The harness's encoding -> fresh plain objects; ValueError for anything else (the caller's `_Lost`)."""
    t = type(e)
    if e is None or t in (bool, int, str, float):
        return e
    if t is list:
        return [_decode(x) for x in e]
    if t is dict and len(e) == 1:
        (tag, x), = e.items()
        if tag == "$float" and type(x) is str:
            return float(x)
        if tag == "$bytes" and type(x) is str:
            return bytes.fromhex(x)
        if tag in ("$list", "$tuple", "$set", "$dict") and type(x) is list:
            if tag == "$list":
                return [_decode(y) for y in x]
            if tag == "$tuple":
                return tuple(_decode(y) for y in x)
            if tag == "$set":
                return frozenset(_decode(y) for y in x)
            return {_decode(k): _decode(y) for k, y in x}
    raise ValueError(f"not plain data: {str(e)[:100]}")


class _Remote:
    """A handle to an object of the program: call it or read an attribute (each a request); nothing else."""

    __slots__ = ("_ask", "_ref")

    def __init__(self, ask, ref: int):
        object.__setattr__(self, "_ask", ask)
        object.__setattr__(self, "_ref", ref)

    def __call__(self, *args, **kwargs):
        return object.__getattribute__(self, "_ask")(
            {"op": "call", "ref": object.__getattribute__(self, "_ref"), "args": [_encode(a) for a in args],
             "kwargs": {str(k): _encode(v) for k, v in kwargs.items()}})

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return object.__getattribute__(self, "_ask")({"op": "attr", "ref": object.__getattribute__(self, "_ref"),
                                                      "name": name})

    def _refuse(self, *_):
        raise TypeError("code_tests: the program returned an object that is not plain data")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __len__ = __iter__ = __contains__ = _refuse
    __hash__ = __add__ = __sub__ = __mul__ = __truediv__ = __floordiv__ = __mod__ = __neg__ = __abs__ = _refuse
    __setattr__ = __getitem__ = __index__ = __int__ = __float__ = _refuse


def _asker(channel):
    def ask(request):
        try:
            reply = channel(request)
        except (EOFError, OSError, TimeoutError, ValueError) as e:
            raise _Lost(str(e)) from None
        try:
            if type(reply) is not dict or len(reply) not in (1, 2):
                raise ValueError("not an answer")
            if "value" in reply:
                return _decode(reply["value"])
            if "ref" in reply and type(reply["ref"]) is int:
                return _Remote(ask, reply["ref"])
            name, message = str(reply["raised"]), str(reply.get("message", ""))
        except Exception as e:  # noqa: BLE001  (anything the program sent that is not an answer: it is lost)
            log.warning("code_tests: a program's answer could not be read (%s: %s); the sample scores 0",
                        type(e).__name__, str(e)[:200])
            raise _Lost(f"{type(e).__name__}: {str(e)[:200]}") from None
        raise _EXCEPTIONS.get(name, _Lost)(message)
    return ask


def free_names(tests: str) -> list[str]:
    """The names the tests read but neither define (assignment, def, class, import, parameter, except ... as)
    nor take from builtins: the ones asked of the program. SyntaxError for tests that are not Python."""
    tree = ast.parse(tests)
    defined = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            defined.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(n.name)
        elif isinstance(n, ast.arg):
            defined.add(n.arg)
        elif isinstance(n, ast.alias):
            defined.add(n.asname or n.name.split(".")[0])
        elif isinstance(n, ast.ExceptHandler) and n.name:
            defined.add(n.name)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(used - defined - _BUILTINS)


def run_tests(sandbox: Sandbox, code: str, tests: str) -> Optional[bool]:
    """Whether `code` passes `tests` (see the module docstring); None when `tests` is not Python. Never raises:
    any failure while judging this one sample is False, logged."""
    try:
        compiled = compile(tests, "tests.py", "exec")
        names = free_names(tests)
    except (SyntaxError, ValueError):
        return None
    with open(_HARNESS, encoding="utf-8") as f:
        harness = f.read()

    def judge(channel) -> bool:
        ask = _asker(channel)
        ask({"op": "ready"})  # the program loaded: its top-level code finished without an exception
        namespace = {"__name__": "__tests__", "__builtins__": builtins}
        for name in names:
            try:
                namespace[name] = ask({"op": "name", "name": name})
            except (NameError, KeyError):  # not the program's (a name the tests only read in a branch not taken)
                pass
        exec(compiled, namespace)
        return True

    sandbox.backend  # noqa: B018  (no boundary here is a setup error for the caller, not one sample's 0)
    try:
        _, passed = sandbox.drive({"main.py": code, "harness.py": harness}, "harness.py", judge)
        return bool(passed)
    except KeyboardInterrupt:
        raise
    except (Exception, _Lost):  # an assert failed, the program raised or stopped answering: the tests did not pass
        return False
    except BaseException as e:  # noqa: B036  (SystemExit of the tests, say: still this one sample's 0)
        log.warning("code_tests: judging one sample failed with %s: %s; it scores 0", type(e).__name__,
                    str(e)[:300])
        return False

"""Judging model-written code against a row's tests without trusting any object the model built.

What it is: `run_tests(sandbox, code, tests) -> bool`. The tests (Python: statements and `assert`s, as
datasets such as MBPP / HumanEval ship them) are rewritten in this process, with `ast`, into a function
whose every `assert` becomes a record of its operands' values, and whose every call result and
non-builtin name is passed through the harness's `__plain__` first (so `abs(f(x) - 3)` never calls a
method of f's result: f's result must already be plain data). Builtins the tests use are bound to the
interpreter's own ones as parameters (a model's `len = ...` does not change them). The program and
the harness (`_code_harness.py`, read-only, outside the writable folder) run in `posttrain.sandbox`;
the harness prints the records as JSON, and the comparisons (==, <, in, ..., truthiness) happen
here, on decoded plain data. An object whose `__eq__` always returns True therefore fails.

What it is not: proof against a program that finds the harness's records in its own process (it
would need the guard's refused introspection or native code); the OS boundary still contains it.
"""

from __future__ import annotations

import ast
import builtins
import json
import operator
import os
import secrets
from typing import Optional

from posttrain.sandbox import Sandbox

_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_code_harness.py")
_OPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
        ast.Is: lambda a, b: _same(a, b), ast.IsNot: lambda a, b: not _same(a, b)}
_BUILTINS = frozenset(n for n in dir(builtins) if not n.startswith("_"))


def _same(a, b) -> bool:
    """`is` on decoded data: identity is meaningful only for None, True and False."""
    return a is b if any(x is None or type(x) is bool for x in (a, b)) else False


class _Wrap(ast.NodeTransformer):
    """Wraps every value-producing call / name / attribute / subscript in `__plain__(...)`, except in
    the callee or attribute-owner position (a method of an object the tests made is still callable)."""

    def __init__(self, builtin_names):
        self.builtin_names = builtin_names

    def _plain(self, node):
        return ast.Call(ast.Name("__plain__", ast.Load()), [node], [])

    def visit(self, node, wrap=True):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute):
                node.func.value = self.visit(node.func.value, wrap=False)
            elif not isinstance(node.func, ast.Name):
                node.func = self.visit(node.func, wrap=False)
            node.args = [self.visit(a) for a in node.args]
            for k in node.keywords:
                k.value = self.visit(k.value)
            return self._plain(node) if wrap else node
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load) and wrap and node.id not in self.builtin_names:
                return self._plain(node)
            return node
        if isinstance(node, ast.Attribute):
            node.value = self.visit(node.value, wrap=False)
            return self._plain(node) if wrap and isinstance(node.ctx, ast.Load) else node
        if isinstance(node, ast.Subscript):
            node.value = self.visit(node.value)
            node.slice = self.visit(node.slice)
            return self._plain(node) if wrap and isinstance(node.ctx, ast.Load) else node
        return self.generic_visit(node)

    def generic_visit(self, node):
        for field, old in ast.iter_fields(node):
            if isinstance(old, list):
                setattr(node, field, [self.visit(x) if isinstance(x, ast.AST) else x for x in old])
            elif isinstance(old, ast.AST):
                setattr(node, field, self.visit(old))
        return node


class _Asserts(ast.NodeTransformer):
    """Turns `assert TEST` into `__check__(i, [operands])`, remembering the comparison for record i."""

    def __init__(self, wrap: _Wrap):
        self.wrap, self.checks = wrap, []

    def visit_Assert(self, node):
        test = node.test
        if isinstance(test, ast.Compare):
            operands, ops = [test.left, *test.comparators], [type(o) for o in test.ops]
        else:
            operands, ops = [test], None
        self.checks.append(ops)
        values = ast.List([self.wrap.visit(o) for o in operands], ast.Load())
        call = ast.Call(ast.Name("__check__", ast.Load()), [ast.Constant(len(self.checks) - 1), values], [])
        return ast.copy_location(ast.Expr(call), node)


def tests_program(tests: str) -> tuple[str, list[str], list]:
    """(source of `def __tests__(__plain__, __check__, *builtins)`, the builtin names it takes, the
    comparison of each check: a list of ast op types, or None for a truthiness check). SyntaxError
    for tests that are not Python."""
    tree = ast.parse(tests)
    assigned = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    names = sorted((used & _BUILTINS) - assigned)
    asserts = _Asserts(_Wrap(set(names)))
    body = asserts.visit(tree).body or [ast.Pass()]
    args = [ast.arg(n) for n in ("__plain__", "__check__", *names)]
    fn = ast.FunctionDef("__tests__", ast.arguments([], args, None, [], [], None, []), body, [], None, None)
    module = ast.fix_missing_locations(ast.Module([fn], []))
    return ast.unparse(module), names, asserts.checks


def _decode(e):
    if isinstance(e, list):
        return [_decode(x) for x in e]
    if isinstance(e, dict):
        (tag, x), = e.items()
        if tag == "$float":
            return float(x)
        if tag == "$bytes":
            return bytes.fromhex(x)
        if tag == "$list":
            return [_decode(y) for y in x]
        if tag == "$tuple":
            return tuple(_decode(y) for y in x)
        if tag == "$set":
            return frozenset(_decode(y) for y in x)
        return {_decode(k): _decode(y) for k, y in x}
    return e


def judge(stdout: str, marker: str, checks: list) -> bool:
    """Whether the harness's record line (the last line starting with `marker`) shows the tests
    finishing with every check true; the comparisons run here, on decoded plain data."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(marker)]
    if not lines:
        return False
    try:
        out = json.loads(lines[-1][len(marker):])
        if out["error"] is not None:
            return False
        for i, encoded in out["records"]:
            values, ops = _decode(encoded), checks[i]
            if ops is None:
                if not values[0]:
                    return False
            elif not all(_OPS[op](a, b) for op, a, b in zip(ops, values, values[1:])):
                return False
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return False
    return True


def run_tests(sandbox: Sandbox, code: str, tests: str) -> Optional[bool]:
    """Whether `code` passes `tests` (see the module docstring); None when `tests` is not Python."""
    try:
        source, names, checks = tests_program(tests)
    except SyntaxError:
        return None
    marker = "#posttrain-" + secrets.token_hex(16) + " "
    spec = json.dumps({"marker": marker, "tests": source, "builtins": names}).encode()
    with open(_HARNESS, encoding="utf-8") as f:
        harness = f.read()
    result = sandbox.run({"main.py": code, "harness.py": harness}, entry="harness.py", stdin=spec)
    return result.status == "ok" and judge(result.stdout, marker, checks)

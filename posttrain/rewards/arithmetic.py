"""The one arithmetic evaluator: exact values of model-written expressions, never `eval`-ed.

What it is: `evaluate(expr, extended=False) -> (value, integer literals in order)`. The strict grammar
(the countdown reward: `rewards.safe_arithmetic`): non-negative decimal integers, `+ - * /` and
parentheses. The extended grammar (the calculator tool: `agentic.tools.calculate`) adds unary `+ -`,
decimal literals (exact: 0.1 is 1/10) and `**` with an integer exponent of at most `MAX_EXPONENT` and
a result of at most `MAX_RESULT_BITS` bits. Safe by construction: the characters are whitelisted
(ASCII only: `ast` would read "٣" or "0x19" too), at most `MAX_CHARS` of them, then `ast.parse`
builds the tree and only the grammar's nodes are evaluated, with Fractions (so 7/2*2 == 7 exactly).
Anything else, a division by zero or too deep a nesting raises ValueError with the reason.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction

MAX_CHARS = 200  # a bound on the parser's and the evaluator's work for one expression
MAX_EXPONENT = 64  # the largest |exponent| of `**` (extended grammar)
MAX_RESULT_BITS = 4096  # a bound on any power's numerator / denominator size (extended grammar)
_STRICT = re.compile(r"[0-9 \t+\-*/()]+")
_EXTENDED = re.compile(r"[0-9 \t+\-*/().]+")
_DECIMAL = re.compile(r"\d+\.?\d*|\.\d+")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expr: str, extended: bool = False) -> tuple[Fraction, list]:
    """(exact value, the number literals in order) of `expr` in the strict or the extended grammar."""
    chars = _EXTENDED if extended else _STRICT
    if not isinstance(expr, str) or len(expr) > MAX_CHARS or not chars.fullmatch(expr):
        raise ValueError("not an arithmetic expression of numbers, + - * / ** and parentheses" if extended else
                         "not an arithmetic expression of integers, + - * / and parentheses")
    source = expr.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise ValueError(f"cannot parse: {getattr(err, 'msg', err)}") from None
    leaves: list = []

    def value(node) -> Fraction:
        if isinstance(node, ast.Constant) and (type(node.value) is int or extended and type(node.value) is float):
            literal = ast.get_source_segment(source, node) or ""
            if extended and not _DECIMAL.fullmatch(literal):
                raise ValueError(f"{literal!r} is not a decimal number")
            leaves.append(node.value)
            return Fraction(literal) if extended else Fraction(node.value)
        if extended and isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if extended and isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            return _power(value(node.left), value(node.right))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _BINOPS[type(node.op)](left, right)
        raise ValueError(f"{type(node).__name__} is not allowed")

    try:
        return value(tree.body), leaves
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


def _power(base: Fraction, exp: Fraction) -> Fraction:
    if exp.denominator != 1 or abs(exp) > MAX_EXPONENT:
        raise ValueError(f"** needs an integer exponent of at most {MAX_EXPONENT} in size")
    if base == 0 and exp < 0:
        raise ValueError("division by zero")
    bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length()) * abs(int(exp))
    if bits > MAX_RESULT_BITS:
        raise ValueError(f"the result of ** would exceed {MAX_RESULT_BITS} bits")
    return base ** int(exp)

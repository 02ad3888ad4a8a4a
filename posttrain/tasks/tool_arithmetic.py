"""A built-in tool task: long arithmetic that a tiny model cannot do alone but can with a calculator.

What it is: from one seed, problems like `437*829` (a product of two `digits`-digit numbers) or
`4821+7730+1956+3307` (a sum of `operands` numbers), split into training and held-out problems
that never share an instance (the key is the multiset of operands, so `829*437` is the same
problem as `437*829`). Each row is {"prompt", "expression", "answer"}; the prompt invites a
calculator call. The expected episode (Hermes-style tool calls, plain text for the byte tokenizer):

    Compute 437*829. Use the calculator.\\n                                              prompt     (not trained)
    <tool_call>{"name": "calculator", "arguments": {"expression": "437*829"}}</tool_call>  action 1   (trained)
    \\n<tool_response>\\n362273\\n</tool_response>\\n                                        tool output (NOT trained)
    #### 362273                                                                          action 2   (trained)

`verify(row, final_action)` (`agentic.env.verify_answer`, the `env.verifier: answer`) is 1.0 when the
final answer (`#### N`, else the last number of the final action, as the arithmetic task reads it)
equals the true value, else 0.0: only the answer counts, not whether the tool was used (an episode's
tool use is counted by `ToolEnv`).
`demonstration(row)` gives that episode as segments [(text, trainable)] with the calculator's real
output, for SFT warm-up: as an SFT "segments" row (`data/formats.py`; `demos/agentic.py` writes them) the
trainable segments are labelled and the tool output is never a target. `make_env(...)` is the `ToolEnv`
with the calculator and this verifier.

Difficulty (`LEVELS`, or a dict of knobs): `op` ("*" or "+"), `digits` (each operand has exactly
this many digits), `operands` (how many numbers).
What it is not: a registry entry of `posttrain.tasks.TASKS` (its rows are episodes, not TaskData) nor
the rollout loop (`posttrain.agentic`).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any, Callable, Mapping

from posttrain.agentic.env import Segment, ToolEnv, verify_answer
from posttrain.agentic.parsing import format_tool_call, render_tool_result
from posttrain.agentic.tools import Calculator
from posttrain.errors import PosttrainError
from posttrain.tasks.base import resolve_difficulty, sample_unique

DEFAULTS = {"op": "*", "digits": 3, "operands": 2}
LEVELS = {
    1: {"op": "*", "digits": 2, "operands": 2},
    2: {"op": "*", "digits": 3, "operands": 2},
    3: {"op": "+", "digits": 4, "operands": 4},
    4: {"op": "*", "digits": 4, "operands": 2},
}
PROMPT = "Compute {expression}. Use the calculator.\n"
ANSWER = "#### {answer}"


@dataclasses.dataclass(frozen=True)
class ToolTaskData:
    name: str
    prompts: list[dict]  # training rows {"prompt", "expression", "answer"}
    eval_prompts: list[dict]  # held-out rows (no instance in common with `prompts`)
    demos: list[list[Segment]]  # one demonstration episode per training row
    verify: Callable[[Mapping, str], float]
    params: dict


def _check(p: dict) -> None:
    if p["op"] not in ("*", "+"):
        raise PosttrainError(f"tool_arithmetic: op must be '*' or '+', got {p['op']!r}")
    if not (isinstance(p["digits"], int) and 1 <= p["digits"] <= 9):
        raise PosttrainError(f"tool_arithmetic: digits must be an int in 1..9, got {p['digits']!r}")
    if not (isinstance(p["operands"], int) and 2 <= p["operands"] <= 8):
        raise PosttrainError(f"tool_arithmetic: operands must be an int in 2..8, got {p['operands']!r}")


def _space(p: dict) -> int:
    """How many distinct instances (multisets of operands) the knobs allow."""
    n = 9 * 10 ** (p["digits"] - 1) if p["digits"] > 1 else 10
    return math.comb(n + p["operands"] - 1, p["operands"])


def make_row(terms: list[int], op: str) -> dict:
    expression = op.join(str(t) for t in terms)
    value = math.prod(terms) if op == "*" else sum(terms)
    return {"prompt": PROMPT.format(expression=expression), "expression": expression, "answer": str(value)}


def _draw(rng: random.Random, p: dict):
    lo, hi = (0, 9) if p["digits"] == 1 else (10 ** (p["digits"] - 1), 10 ** p["digits"] - 1)
    terms = [rng.randint(lo, hi) for _ in range(p["operands"])]
    return tuple(sorted(terms)), make_row(terms, p["op"])


verify = verify_answer  # the task's verifier: the final action's answer against row["answer"]


def demonstration(row: Mapping, *, fmt: str = "hermes", calculator: Calculator | None = None) -> list[Segment]:
    """The expected episode for `row` as [(text, trainable)]: prompt (no), the calculator call (yes), the
    calculator's real output as the environment renders it (no), the answer (yes)."""
    calc = calculator or Calculator()
    args = {"expression": row["expression"]}
    output = calc.call(args)
    return [(row["prompt"], False), (format_tool_call(calc.name, args, fmt), True),
            (render_tool_result(output, fmt), False), (ANSWER.format(answer=output), True)]


def make(difficulty: Any = 2, *, seed: int = 0, n_train: int = 2000, n_eval: int = 200) -> ToolTaskData:
    """`n_train` training and `n_eval` held-out problems at `difficulty` (a LEVELS key or a dict of
    knobs), all distinct as multisets of operands; the same seed gives the same rows."""
    p = resolve_difficulty("tool_arithmetic", difficulty, LEVELS, DEFAULTS)
    _check(p)
    if n_train < 0 or n_eval < 0 or n_train + n_eval > _space(p) // 2:
        raise PosttrainError(f"tool_arithmetic: n_train + n_eval = {n_train + n_eval} is too many for {p} "
                             f"(at most {_space(p) // 2}); ask for fewer or raise digits / operands")
    rng = random.Random(seed)
    rows = sample_unique(rng, lambda: _draw(rng, p), n_eval + n_train, task="tool_arithmetic")
    train, held = rows[n_eval:], rows[:n_eval]
    calc = Calculator()
    return ToolTaskData("tool_arithmetic", train, held, [demonstration(r, calculator=calc) for r in train],
                        verify, p)


def make_env(*, max_turns: int = 3, fmt: str = "hermes") -> ToolEnv:
    """The environment of this task: the calculator as the only tool, scored by `verify`."""
    return ToolEnv([Calculator()], verify, max_turns=max_turns, fmt=fmt)

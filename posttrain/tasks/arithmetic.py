"""Multi-digit arithmetic with carries: chains of + and - over several operands, from a seed.

Rows: {"prompt": "482+57-193=", "completion": "346"} (TRL prompt/completion), RL rows
{"prompt", "answer": "346"} for the `last_number` reward (the completion's final number against
"answer", `rewards/functions.py`), preference rows with a plausible wrong answer (a dropped carry,
an off-by-one) as "rejected". The held-out split is by the multiset of signed terms, so
`a+b-c` held out means `b+a-c` and `-c+a+b`... never appear in training either.

Difficulty knobs (`LEVELS` gives five presets): `digits` (every operand has exactly this many
digits; 1 = 0..9), `operands` (how many numbers, >= 2), `ops` ("+" or "+-"), `min_carries` (the
left-to-right evaluation makes at least this many column carries or borrows, so the problems
are the ones that exercise carrying). `make_addition` wraps `addition.make_pairs` (two numbers,
every pair, as the demo uses it) in the same TaskData.

What it is not: a curriculum scheduler (call `make` per level) or a tokenizer-aware formatter.
"""

from __future__ import annotations

import random
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.rewards.functions import answers_match, extract_answer
from posttrain.tasks.base import TaskData, build, resolve_difficulty, sample_unique

DEFAULTS = {"digits": 2, "operands": 2, "ops": "+", "min_carries": 0}
LEVELS = {
    1: {"digits": 2, "operands": 2, "ops": "+", "min_carries": 0},
    2: {"digits": 2, "operands": 3, "ops": "+", "min_carries": 1},
    3: {"digits": 3, "operands": 2, "ops": "+-", "min_carries": 1},
    4: {"digits": 3, "operands": 3, "ops": "+-", "min_carries": 2},
    5: {"digits": 4, "operands": 4, "ops": "+-", "min_carries": 3},
}


def verify(row: dict, completion: str) -> bool:
    """The completion's final number (`extract_answer(..., last_number=True)`) equals row["answer"]:
    the check the `last_number` GRPO reward makes."""
    pred = extract_answer(str(completion), last_number=True)
    return pred is not None and answers_match(pred, str(row["answer"]))


def carries(a: int, b: int, op: str) -> int:
    """Column carries (an addition of magnitudes) or borrows (a subtraction of the smaller magnitude
    from the larger) made by computing `a op b` by hand."""
    signed = b if op == "+" else -b
    same = a == 0 or signed == 0 or (a > 0) == (signed > 0)  # magnitudes add, else they subtract
    x, y = abs(a), abs(signed)
    if not same:
        x, y = max(x, y), min(x, y)
    n = c = 0
    while x or y:
        d = (x % 10 + y % 10 + c) if same else (x % 10 - y % 10 - c)
        c = int(d >= 10) if same else int(d < 0)
        n += c
        x, y = x // 10, y // 10
    return n


def _check(p: dict) -> None:
    if not (isinstance(p["digits"], int) and 1 <= p["digits"] <= 18):
        raise PosttrainError(f"arithmetic: digits must be an int in 1..18, got {p['digits']!r}")
    if not (isinstance(p["operands"], int) and p["operands"] >= 2):
        raise PosttrainError(f"arithmetic: operands must be an int >= 2, got {p['operands']!r}")
    if p["ops"] not in ("+", "+-", "-+", "-"):
        raise PosttrainError(f"arithmetic: ops must be '+' or '+-', got {p['ops']!r}")
    if not (isinstance(p["min_carries"], int) and p["min_carries"] >= 0):
        raise PosttrainError(f"arithmetic: min_carries must be an int >= 0, got {p['min_carries']!r}")


def _instance(rng: random.Random, p: dict, tries: int = 1000):
    lo, hi = (0, 9) if p["digits"] == 1 else (10 ** (p["digits"] - 1), 10 ** p["digits"] - 1)
    for _ in range(tries):
        terms = [rng.randint(lo, hi) for _ in range(p["operands"])]
        ops = [rng.choice(p["ops"]) for _ in range(p["operands"] - 1)]
        value, n = terms[0], 0
        for op, t in zip(ops, terms[1:]):
            n += carries(value, t, op)
            value = value + t if op == "+" else value - t
        if n >= p["min_carries"]:
            prompt = str(terms[0]) + "".join(f"{op}{t}" for op, t in zip(ops, terms[1:])) + "="
            key = tuple(sorted([(1, terms[0])] + [(1 if op == "+" else -1, t) for op, t in zip(ops, terms[1:])]))
            return key, {"prompt": prompt, "completion": str(value), "answer": str(value)}
    raise PosttrainError(f"arithmetic: no problem with >= {p['min_carries']} carries found in {tries} draws at "
                         f"{p}; lower min_carries or add digits / operands")


def _wrong(rng: random.Random):
    """A plausible wrong answer: off by a power of ten (a dropped or extra carry) or by one."""

    def wrong(inst: dict) -> str:
        value = int(inst["answer"])
        width = max(1, len(str(abs(value))))
        delta = rng.choice([1, -1] + [s * 10 ** k for k in range(1, width) for s in (1, -1)])
        return str(value + delta)

    return wrong


def make(difficulty: Any = 2, *, seed: int = 0, n_eval: int = 200, n_train: int = 2000) -> TaskData:
    """`n_train` training and `n_eval` held-out problems at `difficulty` (a LEVELS key or a dict of
    knobs), all distinct up to reordering the signed terms."""
    p = resolve_difficulty("arithmetic", difficulty, LEVELS, DEFAULTS)
    _check(p)
    rng = random.Random(seed)
    insts = sample_unique(rng, lambda: _instance(rng, p), n_eval + n_train, task="arithmetic")
    return build("arithmetic", insts[n_eval:], insts[:n_eval], wrong=_wrong(random.Random(seed + 1)),
                 verify=verify, reward="last_number", columns=("answer",), params=p)


def make_addition(difficulty: Any = 2, *, seed: int = 0, n_eval: int = 200) -> TaskData:
    """`addition.make_pairs(digits, seed, n_eval)`'s rows (every a+b, held out by the unordered pair)
    as TaskData; `difficulty` is the number of digits (or {"digits": d})."""
    from posttrain.tasks.addition import make_pairs

    # 1 or 2 digits: make_pairs enumerates every pair (3 digits would be a million rows; use "arithmetic")
    p = resolve_difficulty("addition", difficulty, {1: {"digits": 1}, 2: {"digits": 2}}, {"digits": 2})
    if p["digits"] not in (1, 2):
        raise PosttrainError(f"addition: digits must be 1 or 2, got {p['digits']!r}; for more use the arithmetic task")
    n_keys = (10 ** p["digits"]) * (10 ** p["digits"] + 1) // 2
    if not 0 < n_eval < n_keys:
        raise PosttrainError(f"addition: n_eval must be in 1..{n_keys - 1} at {p['digits']} digits, got {n_eval}")
    train, held = make_pairs(p["digits"], seed, n_eval)
    train = [{**r, "answer": r["completion"]} for r in train]
    held = [{**r, "answer": r["completion"]} for r in held]
    return build("addition", train, held, wrong=_wrong(random.Random(seed + 1)), verify=verify,
                 reward="last_number", columns=("answer",), params=p)

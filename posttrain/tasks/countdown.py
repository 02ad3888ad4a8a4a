"""Countdown: reach a target from given numbers with + - * /, each number used at most once.

Rows: {"prompt": "nums 3 7 25 target 46:", "completion": "25+3*7"} (TRL prompt/completion), RL
rows {"prompt", "nums": [3, 7, 25], "target": 46} for the `countdown` reward (`rewards/functions.py`:
the completion's expression, parsed with `ast` and evaluated exactly, must equal the target and use
each given number at most as often as given), preference rows whose "rejected" is a near miss (the
reference with one operator or number changed, so it misses the target or uses a number not given).

Every instance is solvable by construction: draw the numbers, build a random expression tree over
some (or, with `use_all`, all) of them in which every intermediate result is a positive integer
(the classic Countdown rule: exact division, no negatives; here also none above max_target), and
take its value as the target.
Targets that are one of the given numbers (solved by copying it) are not used. The held-out split
is by (sorted numbers, target), so a held-out instance never appears in training, in any order.

Difficulty knobs (`LEVELS` gives five presets): `count` (numbers given), `max_value` (each is in
1..max_value), `ops` (a subset of "+-*/"), `use_all` (the construction uses every number; a
solution may still use fewer), `max_target` (targets are at most this).

What it is not: a solver (instances come with one solution; the verifier accepts any other valid
one, including ones with non-integer intermediate values such as 7/2*2).
"""

from __future__ import annotations

import random
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.rewards.functions import countdown_valid, safe_arithmetic
from posttrain.tasks.base import TaskData, build, resolve_difficulty, sample_unique

DEFAULTS = {"count": 3, "max_value": 25, "ops": "+-*", "use_all": False, "max_target": 999}
LEVELS = {
    1: {"count": 3, "max_value": 20, "ops": "+-"},
    2: {"count": 3, "max_value": 25, "ops": "+-*"},
    3: {"count": 4, "max_value": 50, "ops": "+-*"},
    4: {"count": 5, "max_value": 100, "ops": "+-*/"},
    5: {"count": 6, "max_value": 100, "ops": "+-*/", "use_all": True},
}
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def verify(row: dict, completion: str) -> bool:
    """The `countdown` reward's check: the completion's expression over row["nums"] equals row["target"]."""
    return countdown_valid(completion, row["nums"], row["target"])


def prompt_text(nums: list[int], target: int) -> str:
    return f"nums {' '.join(map(str, nums))} target {target}:"


def _combine(left: tuple, right: tuple, op: str) -> tuple | None:
    """(value, text, precedence) of `left op right`, or None when the result is not a positive
    integer; parentheses only where precedence needs them (a-(b+c), a/(b*c), (a+b)*c)."""
    (a, ta, pa), (b, tb, pb) = left, right
    if op == "+":
        v = a + b
    elif op == "-":
        v = a - b
    elif op == "*":
        v = a * b
    else:
        if b == 0 or a % b:
            return None
        v = a // b
    if v <= 0:
        return None
    p = _PREC[op]
    ta = f"({ta})" if pa < p else ta
    tb = f"({tb})" if pb < p or (pb == p and op in "-/") else tb
    return v, f"{ta}{op}{tb}", p


def _instance(rng: random.Random, p: dict, tries: int = 200):
    for _ in range(tries):
        nums = [rng.randint(1, p["max_value"]) for _ in range(p["count"])]
        k = p["count"] if p["use_all"] else rng.randint(2, p["count"])
        items = [(n, str(n), 3) for n in rng.sample(nums, k)]
        while len(items) > 1:
            for _ in range(20):  # a random merge whose result is a positive integer <= max_target
                i, j = rng.sample(range(len(items)), 2)
                new = _combine(items[i], items[j], rng.choice(p["ops"]))
                if new is not None and new[0] <= p["max_target"]:
                    break
            else:
                break
            items = [x for t, x in enumerate(items) if t not in (i, j)] + [new]
        target, expr, _ = items[0]
        if len(items) == 1 and target not in nums:
            return (tuple(sorted(nums)), target), {"prompt": prompt_text(nums, target), "completion": expr,
                                                   "nums": nums, "target": target}
    raise PosttrainError(f"countdown: no instance found in {tries} draws at {p}; raise max_target or max_value")


def _wrong(rng: random.Random):
    """A near miss: the reference with one operator swapped or one number bumped by one, checked
    to be wrong; else the reference plus one (always off the target)."""

    def wrong(inst: dict) -> str:
        ref = inst["completion"]
        spots = [i for i, ch in enumerate(ref) if ch in "+-*/" or (ch.isdigit() and (i + 1 == len(ref)
                                                                                     or not ref[i + 1].isdigit()))]
        for _ in range(10):
            i = rng.choice(spots)
            if ref[i] in "+-*/":
                cand = ref[:i] + rng.choice([o for o in "+-*" if o != ref[i]]) + ref[i + 1:]
            else:  # the last digit of a number: that number + 1 (maybe not a given number any more)
                j = i
                while j > 0 and ref[j - 1].isdigit():
                    j -= 1
                cand = ref[:j] + str(int(ref[j:i + 1]) + 1) + ref[i + 1:]
            try:
                safe_arithmetic(cand)
            except ValueError:
                continue
            if not verify(inst, cand):
                return cand
        return f"{ref}+1"

    return wrong


def _check(p: dict) -> None:
    if not (isinstance(p["count"], int) and 2 <= p["count"] <= 10):
        raise PosttrainError(f"countdown: count must be an int in 2..10, got {p['count']!r}")
    if not (isinstance(p["max_value"], int) and p["max_value"] >= 2):
        raise PosttrainError(f"countdown: max_value must be an int >= 2, got {p['max_value']!r}")
    if not p["ops"] or set(p["ops"]) - set("+-*/"):
        raise PosttrainError(f"countdown: ops must be a non-empty subset of '+-*/', got {p['ops']!r}")
    if not isinstance(p["use_all"], bool):
        raise PosttrainError(f"countdown: use_all must be true or false, got {p['use_all']!r}")
    if not (isinstance(p["max_target"], int) and p["max_target"] >= 1):
        raise PosttrainError(f"countdown: max_target must be an int >= 1, got {p['max_target']!r}")


def make(difficulty: Any = 2, *, seed: int = 0, n_eval: int = 200, n_train: int = 2000) -> TaskData:
    """`n_train` training and `n_eval` held-out instances at `difficulty` (a LEVELS key or a dict of
    knobs), distinct by (sorted numbers, target). `build` checks that every reference solution passes
    the verifier and every rejected one fails it."""
    p = resolve_difficulty("countdown", difficulty, LEVELS, DEFAULTS)
    _check(p)
    rng = random.Random(seed)
    insts = sample_unique(rng, lambda: _instance(rng, p), n_eval + n_train, task="countdown")
    return build("countdown", insts[n_eval:], insts[:n_eval], wrong=_wrong(random.Random(seed + 1)),
                 verify=verify, reward="countdown", columns=("nums", "target"), params=p)

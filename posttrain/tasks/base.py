"""What every built-in task shares: `TaskData` (the rows a task gives) and the helpers the task modules
build it with (`resolve_difficulty`, `sample_unique`, `build`).

Its own module so that the task modules (arithmetic.py, countdown.py, tool_arithmetic.py) and the registry
in `posttrain.tasks` (the package, which imports the task modules) all import it and not each other.
`posttrain.tasks` re-exports these names: `from posttrain.tasks import TaskData` keeps working.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from posttrain.errors import PosttrainError


@dataclasses.dataclass(frozen=True)
class TaskData:
    name: str  # the task's registry name
    sft_train: list[dict]  # {"prompt", "completion"}
    sft_eval: list[dict]  # held-out {"prompt", "completion"}
    prompts: list[dict]  # RL rows: {"prompt", ...verifier columns}, the training instances
    eval_prompts: list[dict]  # RL rows of the held-out instances
    pairs: list[dict]  # {"prompt", "chosen", "rejected"} over the training instances
    eval_pairs: list[dict]  # preference rows of the held-out instances
    verify: Callable[[dict, str], bool]  # verify(prompt row, completion text) -> correct?
    reward: str  # the GRPO reward function name that applies `verify`'s check
    params: dict  # the resolved difficulty knobs


def resolve_difficulty(task: str, difficulty: Any, levels: dict[int, dict], defaults: dict) -> dict:
    """A task's knobs: LEVELS[difficulty] for an int, else `defaults` updated by a dict (unknown
    knobs are errors that list the known ones)."""
    if isinstance(difficulty, bool):
        raise PosttrainError(f"{task}: difficulty must be a level ({min(levels)}..{max(levels)}) or a dict of knobs")
    if isinstance(difficulty, int):
        if difficulty not in levels:
            raise PosttrainError(f"{task}: difficulty level {difficulty} does not exist; use "
                                 f"{min(levels)}..{max(levels)} or a dict of {sorted(defaults)}")
        return {**defaults, **levels[difficulty]}
    if isinstance(difficulty, dict):
        bad = sorted(set(difficulty) - set(defaults))
        if bad:
            raise PosttrainError(f"{task}: unknown difficulty knobs {bad}; the knobs are {sorted(defaults)}")
        return {**defaults, **difficulty}
    raise PosttrainError(f"{task}: difficulty must be a level ({min(levels)}..{max(levels)}) or a dict of "
                         f"{sorted(defaults)}, got {type(difficulty).__name__}")


def sample_unique(rng, draw: Callable[[], tuple[Any, Any]], n: int, *, task: str, tries_per_item: int = 50) -> list:
    """`n` instances from `draw() -> (key, instance)` with distinct keys (a key names an instance up to
    reordering, so the held-out split is disjoint from training by meaning, not by spelling).
    Raises when the task's space at this difficulty is too small for `n`."""
    seen, out = set(), []
    for _ in range(n * tries_per_item):
        if len(out) == n:
            break
        key, inst = draw()
        if key not in seen:
            seen.add(key)
            out.append(inst)
    if len(out) < n:
        raise PosttrainError(f"{task}: found only {len(out)} distinct instances of the {n} asked for; ask for fewer "
                             "(n_train / n_eval) or raise the difficulty")
    return out


def build(name: str, train: list[dict], held: list[dict], *, wrong: Callable[[dict], str],
          verify: Callable[[dict, str], bool], reward: str, columns: tuple[str, ...], params: dict) -> TaskData:
    """TaskData from instances {"prompt", "completion", **columns}; `wrong(inst)` gives a rejected
    completion, which must fail `verify` (checked: a preference pair must never prefer a tie)."""

    def sft(rows):
        return [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows]

    def rl(rows):
        return [{"prompt": r["prompt"], **{c: r[c] for c in columns}} for r in rows]

    def pairs(rows):
        out = []
        for r in rows:
            bad = wrong(r)
            if verify(r, bad) or not verify(r, r["completion"]):
                raise AssertionError(f"{name}: the pair for {r['prompt']!r} is not (right, wrong): "
                                     f"{r['completion']!r} vs {bad!r}")  # a bug here, not a user error
            out.append({"prompt": r["prompt"], "chosen": r["completion"], "rejected": bad})
        return out

    return TaskData(name=name, sft_train=sft(train), sft_eval=sft(held), prompts=rl(train), eval_prompts=rl(held),
                    pairs=pairs(train), eval_pairs=pairs(held), verify=verify, reward=reward, params=dict(params))


__all__ = ["TaskData", "build", "resolve_difficulty", "sample_unique"]

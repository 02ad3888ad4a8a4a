"""Built-in tasks with verifiable answers, and the tiny-model recipe behind `posttrain demo`.

What it is: a registry of synthetic tasks, `make(task, difficulty=..., seed=..., n_eval=...) ->
TaskData`, where every task gives the same five things from one seed:
  sft_train / sft_eval   TRL prompt/completion rows {"prompt", "completion"} (reference answers)
  prompts / eval_prompts prompt rows for RL: {"prompt", <the columns its reward function reads>}
  pairs / eval_pairs     TRL preference rows {"prompt", "chosen", "rejected"}, rejected always wrong
and `verify(row, completion) -> bool`, the task's checker, with `reward`, the name of the same check
as a GRPO reward function (`grpo.rewards: {<reward>: 1.0}`). The `eval_*` rows are a held-out
split: their instances never occur in any training row (SFT, RL or preference), not even reordered.

Tasks: `addition` (addition.make_pairs, two numbers of `difficulty` digits, as the demo uses it),
`arithmetic` (chains of + / - over several multi-digit operands, a minimum number of carries),
`countdown` (reach a target from given numbers with + - * /). `difficulty` is an int level (see
each module's LEVELS) or a dict of that task's knobs (e.g. {"digits": 3, "operands": 4}).

What it is not: a data loader (write rows with `addition.write_jsonl`, then point `data.train` at
the file) nor the demo itself (`tasks/demo.py`).
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


def _addition(difficulty: Any = 2, seed: int = 0, n_eval: int = 200) -> TaskData:
    from posttrain.tasks import arithmetic

    return arithmetic.make_addition(difficulty, seed=seed, n_eval=n_eval)


def _arithmetic(difficulty: Any = 2, seed: int = 0, n_eval: int = 200, **kw) -> TaskData:
    from posttrain.tasks import arithmetic

    return arithmetic.make(difficulty, seed=seed, n_eval=n_eval, **kw)


def _countdown(difficulty: Any = 2, seed: int = 0, n_eval: int = 200, **kw) -> TaskData:
    from posttrain.tasks import countdown

    return countdown.make(difficulty, seed=seed, n_eval=n_eval, **kw)


# name -> make function (imported on use: `import posttrain.tasks` stays cheap)
TASKS: dict[str, Callable[..., TaskData]] = {
    "addition": _addition,
    "arithmetic": _arithmetic,
    "countdown": _countdown,
}


def make(task: str, *, difficulty: Any = 2, seed: int = 0, n_eval: int = 200, **kw) -> TaskData:
    """The rows of built-in `task` at `difficulty` (a level or a dict of knobs), from `seed`, with
    `n_eval` held-out instances. Extra keywords go to the task (e.g. `n_train=`)."""
    if task not in TASKS:
        raise PosttrainError(f"unknown task {task!r}; built-in tasks are {', '.join(sorted(TASKS))}")
    return TASKS[task](difficulty, seed=seed, n_eval=n_eval, **kw)


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


__all__ = ["TASKS", "TaskData", "make"]

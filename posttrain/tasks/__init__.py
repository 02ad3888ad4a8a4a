"""Built-in tasks with verifiable answers: the rows of `posttrain demo` and of the learning tests.

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
`countdown` (reach a target from given numbers with + - * /), `shapes` (an image task: "How many squares?" on
small generated pictures, TRL vision rows with PIL images; `shapes.write_rows` saves them, `shapes.write_model`
writes a tiny random Qwen3-VL to train from scratch). `difficulty` is an int level (see
each module's LEVELS) or a dict of that task's knobs (e.g. {"digits": 3, "operands": 4}).

`tool_arithmetic` (its own module, not in TASKS: its rows are tool-use episodes for `posttrain.agentic`)
gives long products / sums a tiny model can compute only with the calculator tool.

What it is not: a data loader (write rows with `addition.write_jsonl`, then point `data.train` at
the file) nor the demos that train on them (`posttrain/demos/`).
"""

from __future__ import annotations

from typing import Any, Callable

from posttrain.errors import PosttrainError

# the shared pieces live in base.py (imported by the task modules too); re-exported here
from posttrain.tasks.base import TaskData, build, resolve_difficulty, sample_unique  # noqa: F401


def _addition(difficulty: Any = 2, seed: int = 0, n_eval: int = 200) -> TaskData:
    from posttrain.tasks import arithmetic

    return arithmetic.make_addition(difficulty, seed=seed, n_eval=n_eval)


def _arithmetic(difficulty: Any = 2, seed: int = 0, n_eval: int = 200, **kw) -> TaskData:
    from posttrain.tasks import arithmetic

    return arithmetic.make(difficulty, seed=seed, n_eval=n_eval, **kw)


def _countdown(difficulty: Any = 2, seed: int = 0, n_eval: int = 200, **kw) -> TaskData:
    from posttrain.tasks import countdown

    return countdown.make(difficulty, seed=seed, n_eval=n_eval, **kw)


def _shapes(difficulty: Any = 2, seed: int = 0, n_eval: int = 200, **kw) -> TaskData:
    from posttrain.tasks import shapes

    return shapes.make(difficulty, seed=seed, n_eval=n_eval, **kw)


# name -> make function (imported on use: `import posttrain.tasks` stays cheap)
TASKS: dict[str, Callable[..., TaskData]] = {
    "addition": _addition,
    "arithmetic": _arithmetic,
    "countdown": _countdown,
    "shapes": _shapes,
}


def make(task: str, *, difficulty: Any = 2, seed: int = 0, n_eval: int = 200, **kw) -> TaskData:
    """The rows of built-in `task` at `difficulty` (a level or a dict of knobs), from `seed`, with
    `n_eval` held-out instances. Extra keywords go to the task (e.g. `n_train=`)."""
    if task not in TASKS:
        raise PosttrainError(f"unknown task {task!r}; built-in tasks are {', '.join(sorted(TASKS))}")
    return TASKS[task](difficulty, seed=seed, n_eval=n_eval, **kw)


__all__ = ["TASKS", "TaskData", "make"]

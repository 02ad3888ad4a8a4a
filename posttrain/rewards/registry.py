"""The reward registry: the names `grpo.rewards` / `ppo.rewards` accept, and how each is built.

What it is: `REWARDS` maps a built-in reward's name to (builder(section, tokenizer) -> function,
one-line description); `reward_functions(section, tok, prompts, key=...)` turns a section's
`rewards: {name: weight}` into (functions, weights), importing "package.module:function" names and
checking their signatures against the prompt rows' columns. Every error names `<key>.rewards` and
lists the registry, so a new built-in needs only its entry here.

What it is not: the rewards themselves (`rewards.functions`) or the runner (`rewards.runner`).
"""

from __future__ import annotations

import importlib
import inspect

from posttrain.errors import PosttrainError
from posttrain.rewards import functions as F
from posttrain.rewards.model import RewardModel
from posttrain.sandbox import MODES


def _format(s, tok, key):
    if not s.format_pattern:
        raise PosttrainError(f"{key}.rewards names 'format' but {key}.format_pattern is not set")
    return F.format_reward(s.format_pattern)


def _reward_model(s, tok, key):
    if not s.reward_model:
        raise PosttrainError(f"{key}.rewards names 'reward_model' but {key}.reward_model (a folder) is not set")
    return F.reward_model_reward(RewardModel(s.reward_model))


REWARDS = {
    "math_answer": (lambda s, tok, key: F.math_answer, "the \\boxed{} / #### answer against the 'answer' column"),
    "last_number": (lambda s, tok, key: F.math_answer_reward(last_number=True, name="last_number"),
                    "math_answer, falling back to the completion's last number"),
    "countdown": (lambda s, tok, key: F.countdown, "the expression over the row's 'nums' equals its 'target'"),
    "code_tests": (lambda s, tok, key: F.code_tests_reward(sandbox=s.sandbox),
                   "the completion's code against the row's 'tests', in the sandbox"),
    "format": (_format, "the completion fully matches <key>.format_pattern"),
    "overlong": (lambda s, tok, key: F.overlong_penalty(s.max_new_tokens, s.overlong_cache, tokenizer=tok),
                 "DAPO's soft penalty in the last <key>.overlong_cache tokens"),
    "reward_model": (_reward_model, "the score of the reward model at <key>.reward_model"),
}


def _check_signature(fn, name: str, columns, key: str) -> None:
    """A 'module:function' reward must take what the runner passes it (prompts, completions, completion_ids
    and the data columns, as keywords); otherwise every call would fail, zeroed, and the run learn nothing."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): the runner counts its failures
        return
    bind = sig.bind if columns is not None else sig.bind_partial  # columns unknown: no "missing argument"
    try:
        bind(**dict.fromkeys(["prompts", "completions", "completion_ids", *(columns or ())]))
    except TypeError as err:
        raise PosttrainError(f"{key}.rewards: {name!r} cannot take a reward function's arguments ({err}); it is "
                             "called as f(prompts=..., completions=..., completion_ids=..., **data columns"
                             f" ({', '.join(columns or ()) or 'none'})), so define it as def f(prompts, completions, "
                             "**kwargs)") from None


def _imported(name: str, columns, key: str):
    mod, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except Exception as err:  # ImportError, AttributeError, SyntaxError in the user's module, ...
        raise PosttrainError(f"{key}.rewards: cannot import {name!r} ({type(err).__name__}: {err}); give "
                             "'package.module:function'") from None
    if not callable(fn):
        raise PosttrainError(f"{key}.rewards: {name!r} is not a function")
    _check_signature(fn, name, columns, key)
    return fn


def reward_functions(section, tok, prompts=None, *, key: str = "grpo") -> tuple[list, list[float]]:
    """(functions, weights) named by `section.rewards` (a grpo or ppo section; `key` names it in errors);
    unknown names are config errors. `prompts`: the prompt rows, whose data columns the functions get
    (an imported function's signature is checked against them; None: not checked for missing arguments)."""
    if section.sandbox not in MODES:
        raise PosttrainError(f"{key}.sandbox: unknown mode {section.sandbox!r}; use one of {', '.join(MODES)}")
    columns = None if prompts is None else sorted({k for q in prompts for k in q.columns})
    funcs = []
    for name in section.rewards:
        if name in REWARDS:
            funcs.append(REWARDS[name][0](section, tok, key))
        elif ":" in name:
            funcs.append(_imported(name, columns, key))
        else:
            raise PosttrainError(f"{key}.rewards: unknown reward {name!r}; use {', '.join(REWARDS)}, or "
                                 "'package.module:function'")
    return funcs, [float(w) for w in section.rewards.values()]

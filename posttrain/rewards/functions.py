r"""Reward functions for the RL trainers: the protocol, the built-in rewards, and the runner.

What it is:
- The protocol (TRL's): a reward function is any callable
  `f(*, prompts: list[str], completions: list[str], **columns) -> list[float | None]`, called once
  per batch with keywords. `columns` are the dataset row's other fields, one list per column
  (e.g. `answer=[...]`), plus what the trainer adds (`completion_ids`: the completion's token ids,
  one list per sample, as TRL's GRPOTrainer passes them). `None` means "not applicable to this
  sample". Because it is TRL's protocol, a TRL reward function for plain text
  (e.g. `trl.rewards.get_soft_overlong_punishment(...)`) can be passed as is. A function should
  accept `**_` for the columns it does not use.
- Built-ins: `math_answer` (final-answer match, `\boxed{}` / `####`, numeric equivalence),
  `format_reward(pattern)` (regex full match; `THINK_FORMAT` is TRL's think-tag format),
  `length_reward(target)`, `overlong_penalty(max_len, cache)` (DAPO's soft overlong punishment),
  `reward_model_reward(model)` (a `RewardModel`'s scores).
- The runner `score(funcs, weights, prompts, completions, columns)`: runs each function once on the
  batch and returns the [N, F] reward matrix, a keep mask and metrics. A function that raises, runs
  past `timeout_s`, returns the wrong number of values, or returns a non-finite value or a non-number
  is counted in the metrics and handled per `on_error`; it never ends the run.

What it is not: the advantage computation or the group normalisation (the GRPO trainer does that
with `combine`'s totals), nor a sandbox: a reward function runs in this process with its rights.
References: TRL 1.16 `trl/rewards/` and `GRPOTrainer._calculate_rewards` (protocol, None -> NaN,
metric names `rewards/{name}/mean|std`, weighted nansum); DAPO (Yu et al. 2025, arXiv 2503.14476)
eq. 13; GSM8K's `#### answer` convention (Cobbe et al. 2021); MATH's `\boxed{}` (Hendrycks et al. 2021).
"""

from __future__ import annotations

import math
import numbers
import re
import threading
import warnings
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import numpy as np

from posttrain.errors import PosttrainError

if TYPE_CHECKING:
    from posttrain.rewards.model import RewardModel

RewardFunc = Callable[..., Sequence[Optional[float]]]


def _text(completion: Any) -> str:
    """A completion's text: the string itself, or the last message's content of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"a completion is {type(completion).__name__}; give a string or a list of messages")


# ----------------------------------------------------------------------------- maths answers

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
# Exponents are capped at 3 digits: Fraction("1e999999999") would build a 10**999999999 integer.
_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d{1,3})?")
_FRAC = re.compile(r"([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def boxed_contents(text: str) -> list[str]:
    r"""The contents of the top-level `\boxed{...}` (or `\fbox{...}`) groups of `text`, in order.
    Braces are matched with nesting (`\boxed{\frac{1}{2}}` -> `\frac{1}{2}`); LaTeX's escaped
    braces `\{ \}` do not count. An opener without its closing brace (a truncated completion) is
    skipped."""
    out, pos = [], 0
    while (m := _BOXED.search(text, pos)) is not None:
        depth, i = 1, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c == "\\":
                i += 2
                continue
            depth += (c == "{") - (c == "}")
            i += 1
        if depth:
            pos = m.end()
            continue
        out.append(text[m.end():i - 1])
        pos = i
    return out


def extract_answer(text: str, *, last_number: bool = False) -> Optional[str]:
    r"""The final answer of a solution text, or None when it has none.

    Rule, first that applies: (1) the content of the last complete `\boxed{...}` (an answer that is
    itself wholly `\boxed{x}` is unwrapped); (2) the rest of the line after the last `####`
    (GSM8K's convention), if not empty; (3) with `last_number=True` only, the last number
    in the text (integers, thousands commas, decimals, `a/b`). Off by default: a GRPO reward that
    pays for any trailing number pays for answers the model did not commit to."""
    boxes = boxed_contents(text)
    if boxes:
        ans = boxes[-1].strip()
        while (m := _BOXED.match(ans)) and ans.endswith("}") and boxed_contents(ans) == [ans[m.end():-1]]:
            ans = ans[m.end():-1].strip()
        return ans
    if "####" in text:
        line = text.rsplit("####", 1)[1].split("\n", 1)[0].strip()
        if line:
            return line
    if last_number:
        nums = _NUMBER.findall(text)
        if nums:
            return nums[-1]
    return None


def normalize_answer(s: str) -> str:
    r"""The comparison form of an answer string: `\text{x}`-style wrappers unwrapped, `\left`/`\right`,
    LaTeX spaces (`\! \, \; \:`), `$` and `\$` and all whitespace removed, `\dfrac`/`\tfrac` -> `\frac`,
    thousands commas removed (`1,000,000` -> `1000000`; `1,2` is kept), then a trailing `.` and a
    trailing `%` / `\%` removed (so `50\%` == `50`)."""
    s = _TEXT.sub(r"\1", s.strip())
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    for token in ("\\!", "\\,", "\\;", "\\:", "\\ ", "\\$", "$"):
        s = s.replace(token, "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    s = s.rstrip(".")
    for pct in ("\\%", "%"):
        if s.endswith(pct):
            s = s[:-len(pct)]
    return s


def _as_fraction(s: str) -> Optional[Fraction]:
    """The exact value of a normalised answer: a decimal (`3`, `-0.5`, `.5`, `1e3`), `a/b` with
    decimal a, b, or `\\frac{a}{b}`; None for anything else (or a zero denominator)."""
    try:
        if m := _FRAC.fullmatch(s):
            num, den = _as_fraction(m.group(2)), _as_fraction(m.group(3))
            if num is None or den is None:
                return None
            value = num / den
            return -value if m.group(1) == "-" else value
        if s.count("/") == 1:
            a, b = s.split("/")
            if _DECIMAL.fullmatch(a) and _DECIMAL.fullmatch(b):
                return Fraction(a) / Fraction(b)
            return None
        return Fraction(s) if _DECIMAL.fullmatch(s) else None
    except (ZeroDivisionError, ValueError):
        return None


def answers_match(predicted: str, reference: str) -> bool:
    """Equal as exact numbers when both normalised strings parse as numbers (`1,000` == `1000`,
    `0.5` == `1/2` == `.5` == `\\frac{1}{2}`, `3.0` == `3`); otherwise equal as normalised strings."""
    p, r = normalize_answer(predicted), normalize_answer(reference)
    fp, fr = _as_fraction(p), _as_fraction(r)
    if fp is not None and fr is not None:
        return fp == fr
    return p == r


def _reference(value: Any) -> Optional[str]:
    """The reference answer of a row: None/empty -> None; a number -> its str; a string with `####`
    or `\\boxed{}` -> what `extract_answer` finds there; otherwise the string itself."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return str(value) if math.isfinite(value) else None
    text = str(value).strip()
    if not text:
        return None
    return extract_answer(text) if ("####" in text or _BOXED.search(text)) else text


class MathAnswer:
    """1.0 when the completion's final answer (`extract_answer`) equals the row's reference
    (`answers_match`), 0.0 when it differs or the completion has no answer, None when the row has
    no reference (missing, empty, or a `####`/`\\boxed` text with nothing to extract)."""

    def __init__(self, column: str = "answer", *, last_number: bool = False, name: str = "math_answer"):
        self.column, self.last_number, self.name = column, last_number, name
        self.__name__ = name

    def __call__(self, prompts: Sequence, completions: Sequence, **columns) -> list[Optional[float]]:
        if self.column not in columns:
            raise PosttrainError(f"reward {self.name!r} needs the column {self.column!r}; the batch has "
                                 f"{sorted(columns)}. Name the reference column with math_answer_reward(column=...)")
        out: list[Optional[float]] = []
        for completion, ref in zip(completions, columns[self.column], strict=True):
            ref = _reference(ref)
            if ref is None:
                out.append(None)
                continue
            pred = extract_answer(_text(completion), last_number=self.last_number)
            out.append(float(pred is not None and answers_match(pred, ref)))
        return out


def math_answer_reward(column: str = "answer", *, last_number: bool = False, name: str = "math_answer") -> MathAnswer:
    """A `math_answer` that reads the reference from `column`, optionally with the last-number fallback."""
    return MathAnswer(column, last_number=last_number, name=name)


def math_answer(prompts: Sequence, completions: Sequence, answer: Sequence, **_) -> list[Optional[float]]:
    r"""Final-answer match against the `answer` column: `\boxed{}` first, then `####`; see `MathAnswer`."""
    return MathAnswer()(prompts, completions, answer=answer)


# ----------------------------------------------------------------------------- format, length, overlong

# TRL 1.16 `think_format_reward`'s rule as a full match: the text starts with `<think>`, has no
# second `<think>`, and a `</think>` closes the first (anything may follow).
THINK_FORMAT = r"<think>(?!.*<think>).*?</think>.*"


class FormatReward:
    """1.0 if `re.fullmatch(pattern, completion, flags)`, else 0.0 (the whole completion must match)."""

    def __init__(self, pattern: str, *, flags: int = re.DOTALL, name: str = "format_reward"):
        try:
            self.regex = re.compile(pattern, flags)
        except re.error as e:
            raise PosttrainError(f"format reward {name!r}: the pattern {pattern!r} is not a regex: {e}") from None
        self.name = self.__name__ = name

    def __call__(self, prompts: Sequence, completions: Sequence, **_) -> list[float]:
        return [float(self.regex.fullmatch(_text(c)) is not None) for c in completions]


def format_reward(pattern: str, *, flags: int = re.DOTALL, name: str = "format_reward") -> FormatReward:
    """A reward of 1.0 for completions that match `pattern` whole (`re.fullmatch`), else 0.0.
    `format_reward(THINK_FORMAT)` equals TRL's `think_format_reward` (tests check it)."""
    return FormatReward(pattern, flags=flags, name=name)


def _token_lengths(columns: Mapping, completions: Sequence, tokenizer: Any, name: str) -> list[int]:
    """Completion lengths in tokens: from the `completion_ids` column (the sampled ids, exact: what
    TRL's GRPOTrainer passes), else, with a tokenizer, by re-encoding the text without special tokens
    (can differ from the sampled count, e.g. by a stop token that decoding dropped)."""
    if "completion_ids" in columns:
        return [len(ids) for ids in columns["completion_ids"]]
    if tokenizer is not None:
        return [len(tokenizer.encode(_text(c), add_special_tokens=False)) for c in completions]
    raise PosttrainError(f"reward {name!r} needs the column 'completion_ids' (token ids per completion) or a "
                         f"tokenizer= to count tokens; the batch has {sorted(columns)}")


class LengthReward:
    """-min(1, |L - target| / target): 0 at the target length, falling linearly to -1 at a
    distance of `target` (L = 0 or L >= 2 * target) and flat there. L is the completion's length in
    characters (`unit="chars"`) or in tokens (`unit="tokens"`, see `_token_lengths`)."""

    def __init__(self, target: int, *, unit: str = "chars", tokenizer: Any = None, name: str = "length_reward"):
        if not target > 0:
            raise PosttrainError(f"length reward: target must be > 0, got {target}")
        if unit not in ("chars", "tokens"):
            raise PosttrainError(f"length reward: unit must be 'chars' or 'tokens', got {unit!r}")
        self.target, self.unit, self.tokenizer = target, unit, tokenizer
        self.name = self.__name__ = name

    def __call__(self, prompts: Sequence, completions: Sequence, **columns) -> list[float]:
        if self.unit == "tokens":
            lengths = _token_lengths(columns, completions, self.tokenizer, self.name)
        else:
            lengths = [len(_text(c)) for c in completions]
        return [-min(1.0, abs(n - self.target) / self.target) for n in lengths]


def length_reward(target: int, *, unit: str = "chars", tokenizer: Any = None,
                  name: str = "length_reward") -> LengthReward:
    """A reward for completions near `target` characters or tokens; see `LengthReward`."""
    return LengthReward(target, unit=unit, tokenizer=tokenizer, name=name)


class OverlongPenalty:
    r"""DAPO's soft overlong punishment (eq. 13), L = number of completion tokens:
    0 if L <= L_max - L_cache; (L_max - L_cache - L) / L_cache if L_max - L_cache < L <= L_max;
    -1 if L > L_max. Same inputs and values as TRL's `get_soft_overlong_punishment` (L from the
    `completion_ids` column; `tokenizer=` is a fallback when that column is absent, see `_token_lengths`).
    With a sampler capped at L_max new tokens, a truncated completion has L = L_max: -1."""

    def __init__(self, max_completion_length: int, soft_cache_length: int, *, tokenizer: Any = None,
                 name: str = "overlong_penalty"):
        if not 0 <= soft_cache_length <= max_completion_length:
            raise PosttrainError(f"overlong penalty: need 0 <= soft_cache_length <= max_completion_length, got "
                                 f"{soft_cache_length} and {max_completion_length}")
        self.max_len, self.cache, self.tokenizer = max_completion_length, soft_cache_length, tokenizer
        self.name = self.__name__ = name

    def __call__(self, prompts: Sequence = (), completions: Sequence = (), **columns) -> list[float]:
        out = []
        for n in _token_lengths(columns, completions, self.tokenizer, self.name):
            if n <= self.max_len - self.cache:
                out.append(0.0)
            elif n <= self.max_len:
                out.append((self.max_len - self.cache - n) / self.cache)
            else:
                out.append(-1.0)
        return out


def overlong_penalty(max_completion_length: int, soft_cache_length: int, *, tokenizer: Any = None,
                     name: str = "overlong_penalty") -> OverlongPenalty:
    """DAPO's soft overlong punishment of completion token lengths; see `OverlongPenalty`."""
    return OverlongPenalty(max_completion_length, soft_cache_length, tokenizer=tokenizer, name=name)


class RewardModelReward:
    """`model.score(prompts, completions)` as a list of floats (the trained reward model's scores)."""

    def __init__(self, model: "RewardModel", *, name: str = "reward_model"):
        self.model = model
        self.name = self.__name__ = name

    def __call__(self, prompts: Sequence, completions: Sequence, **_) -> list[float]:
        return np.asarray(self.model.score(list(prompts), list(completions)), np.float64).reshape(-1).tolist()


def reward_model_reward(model: "RewardModel", *, name: str = "reward_model") -> RewardModelReward:
    """A reward function that returns `model.score(prompts, completions)` (a `RewardModel`)."""
    return RewardModelReward(model, name=name)


# ----------------------------------------------------------------------------- the runner

# Threads of reward functions that ran past their timeout. Python cannot stop a thread, so they are
# left running as daemon threads (which do not hold up interpreter exit) and counted in the metrics.
_ABANDONED: list[threading.Thread] = []
_ABANDONED_LOCK = threading.Lock()


def reward_names(funcs: Sequence[RewardFunc]) -> list[str]:
    """Metric names of reward functions: a `name` attribute if it is a string, else `__name__`,
    else the type's name; repeats get `_2`, `_3`, ... (`[f, f]` -> `["f", "f_2"]`)."""
    names, used = [], set()
    for f in funcs:
        name = getattr(f, "name", None)
        if not isinstance(name, str) or not name:
            name = getattr(f, "__name__", None) or type(f).__name__
        base, k = name, 1
        while name in used:
            k += 1
            name = f"{base}_{k}"
        used.add(name)
        names.append(name)
    return names


def _call(f: RewardFunc, kwargs: dict, timeout_s: Optional[float], name: str) -> tuple[str, Any]:
    """("ok", result), ("error", exception) or ("timeout", None). With a timeout the function runs in a
    fresh daemon thread; a ThreadPoolExecutor is not used because its workers are joined at
    interpreter exit, so one hung reward function would hang the end of the run."""
    if timeout_s is None:
        try:
            return "ok", f(**kwargs)
        except Exception as e:
            return "error", e
    box: dict[str, Any] = {}

    def work():
        try:
            box["out"] = f(**kwargs)
        except BaseException as e:  # anything, SystemExit included, is this function's failure
            box["exc"] = e

    thread = threading.Thread(target=work, name=f"reward-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        with _ABANDONED_LOCK:
            _ABANDONED.append(thread)
        return "timeout", None
    if "exc" in box:
        return "error", box["exc"]
    if "out" not in box:
        return "error", RuntimeError("the worker thread ended without a result")
    return "ok", box["out"]


def _as_float(v: Any) -> Optional[float]:
    """float(v) for a real number (bool, int, float, NumPy scalar, 0-d array), else None."""
    if isinstance(v, numbers.Real):
        return float(v)
    if isinstance(v, (str, bytes)) or getattr(v, "ndim", 0) != 0 or not hasattr(v, "__float__"):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def combine(rewards: np.ndarray, weights: Optional[Sequence[float]] = None) -> np.ndarray:
    """The [N] total reward: sum over functions of weight * reward, NaN (None) entries skipped, and
    NaN where every function returned None (TRL's weighted nansum and unscorable rows)."""
    rewards = np.asarray(rewards, np.float64)
    w = np.ones(rewards.shape[1]) if weights is None else np.asarray(weights, np.float64)
    total = np.nansum(rewards * w[None, :], axis=1)
    total[np.isnan(rewards).all(axis=1)] = np.nan
    return total


def score(funcs: Sequence[RewardFunc], weights: Optional[Sequence[float]], prompts: Sequence,
          completions: Sequence, columns: Optional[Mapping[str, Sequence]] = None, *,
          timeout_s: Optional[float] = None, on_error: str = "zero") -> tuple[np.ndarray, np.ndarray, dict]:
    """Score a batch of N samples with F reward functions.

    Each function is called once, `f(prompts=..., completions=..., **columns)`, on its own shallow
    copies of the lists, in order. Returns `(rewards, keep, stats)`:
    - rewards: [N, F] float64, unweighted, NaN where a function returned None (or, with "drop",
      where its value was lost); `combine(rewards, weights)` gives the totals.
    - keep: [N] bool, False for samples dropped by `on_error="drop"`.
    - stats, for each function name (see `reward_names`): `rewards/<name>/mean` and `/std` (NumPy
      mean and Bessel-corrected std, as TRL's nanstd, over the valid numbers the function returned:
      no None, failures or substitutes; NaN when there are none / fewer than 2), `/errors` (calls that
      raised or returned something that is not N values), `/timeouts` (calls that ran past
      `timeout_s`), `/nonfinite` (samples whose value was NaN, +-inf or not a real number); and
      `reward` (the mean of the weighted total over kept, scorable samples), `rewards/dropped`
      (samples with keep False), `rewards/abandoned_threads` (timed-out calls still running).
    Failures, per `on_error`: "zero" sets the function's reward to 0.0 for the affected samples
    (the whole batch for a raise, timeout or wrong result; the one sample for a bad value); "drop"
    sets keep False for them. Each failure also warns once per distinct message.
    `timeout_s=None` runs the functions in the calling thread (no timeout). With a timeout each call
    runs in a daemon thread; one that overruns is abandoned, still running (Python cannot kill a
    thread), and the next call gets a fresh thread, so it never blocks the run.
    Errors in the arguments themselves (lengths, names, on_error) raise PosttrainError."""
    if on_error not in ("zero", "drop"):
        raise PosttrainError(f"reward on_error must be 'zero' or 'drop', got {on_error!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise PosttrainError(f"reward timeout_s must be > 0 seconds or None, got {timeout_s}")
    funcs = list(funcs)
    for f in funcs:
        if not callable(f):
            raise PosttrainError(f"reward function {f!r} is not callable")
    n, nf = len(prompts), len(funcs)
    if len(completions) != n:
        raise PosttrainError(f"rewards: {n} prompts but {len(completions)} completions")
    columns = dict(columns or {})
    for key, col in columns.items():
        if key in ("prompts", "completions"):
            raise PosttrainError(f"rewards: a column may not be named {key!r} (it is a reward function argument)")
        if len(col) != n:
            raise PosttrainError(f"rewards: column {key!r} has {len(col)} values for {n} samples")
    w = np.ones(nf) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    if w.shape != (nf,) or not np.isfinite(w).all():
        raise PosttrainError(f"rewards: need {nf} finite weights (one per reward function), got {weights!r}")

    names = reward_names(funcs)
    rewards = np.full((n, nf), np.nan)
    keep = np.ones(n, bool)
    stats: dict[str, float] = {}
    for j, (f, name) in enumerate(zip(funcs, names)):
        kwargs = {"prompts": list(prompts), "completions": list(completions),
                  **{k: list(v) for k, v in columns.items()}}
        status, out = _call(f, kwargs, timeout_s, name)
        counts = {"errors": 0, "timeouts": 0, "nonfinite": 0}
        values = np.full(n, np.nan)
        bad = np.zeros(n, bool)
        whole_batch = status != "ok"
        if status == "timeout":
            counts["timeouts"] = 1
            warnings.warn(f"reward function {name!r} ran past timeout_s={timeout_s}; its rewards count as failed "
                          f"({on_error}) and its thread is left running", RuntimeWarning, stacklevel=2)
        elif status == "error":
            counts["errors"] = 1
            warnings.warn(f"reward function {name!r} raised {type(out).__name__}: {out}; its rewards count as "
                          f"failed ({on_error})", RuntimeWarning, stacklevel=2)
        elif isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__") or len(out) != n:
            counts["errors"], whole_batch = 1, True
            got = f"{len(out)} values" if hasattr(out, "__len__") else type(out).__name__
            warnings.warn(f"reward function {name!r} returned {got} for {n} samples; its rewards count as failed "
                          f"({on_error})", RuntimeWarning, stacklevel=2)
        else:
            for i, v in enumerate(out):
                if v is None:
                    continue
                x = _as_float(v)
                if x is None or not math.isfinite(x):
                    bad[i] = True
                else:
                    values[i] = x
            counts["nonfinite"] = int(bad.sum())
            if counts["nonfinite"]:
                first = out[int(np.argmax(bad))]
                warnings.warn(f"reward function {name!r} returned {counts['nonfinite']} values that are not finite "
                              f"numbers (first: {first!r}); they count as failed ({on_error})", RuntimeWarning,
                              stacklevel=2)
        valid = values[~np.isnan(values)]
        stats[f"rewards/{name}/mean"] = float(valid.mean()) if valid.size else math.nan
        stats[f"rewards/{name}/std"] = float(valid.std(ddof=1)) if valid.size > 1 else math.nan
        for kind, c in counts.items():
            stats[f"rewards/{name}/{kind}"] = float(c)
        failed = np.ones(n, bool) if whole_batch else bad
        if on_error == "zero":
            values[failed] = 0.0
        else:
            keep &= ~failed
        rewards[:, j] = values

    total = combine(rewards, w)[keep]
    total = total[~np.isnan(total)]
    stats["reward"] = float(total.mean()) if total.size else math.nan
    stats["rewards/dropped"] = float((~keep).sum())
    with _ABANDONED_LOCK:
        _ABANDONED[:] = [t for t in _ABANDONED if t.is_alive()]
        stats["rewards/abandoned_threads"] = float(len(_ABANDONED))
    return rewards, keep, stats

r"""Reward functions for the RL trainers: the protocol and the built-in rewards (the runner that calls
them safely is `rewards/runner.py`).

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
  `countdown` (the completion is an arithmetic expression over the row's `nums`, each at most
  once, equal to its `target`; parsed with `ast` and evaluated exactly, never `eval`),
  `format_reward(pattern)` (regex full match; `THINK_FORMAT` is TRL's think-tag format),
  `length_reward(target)`, `overlong_penalty(max_len, cache)` (DAPO's soft overlong punishment),
  `reward_model_reward(model)` (a `RewardModel`'s scores), `code_tests` (the completion's code,
  its last ```python block or its whole text, against the row's `tests` column of asserts, run in
  `posttrain.sandbox` with time and memory limits and no network, the asserts' operands compared
  in this process as plain data: 1.0 if every assert holds, else 0.0;
  `code_tests_reward(column, timeout_s=, memory_mb=, sandbox=)` sets them).

What it is not: the advantage computation or the group normalisation (the GRPO trainer does that
with `combine`'s totals), nor a sandbox: a reward function runs in this process with its rights
(only `code_tests` runs the model's code, and that behind posttrain.sandbox's OS boundary).
References: TRL 1.16 `trl/rewards/` and `GRPOTrainer._calculate_rewards` (protocol, None -> NaN,
metric names `rewards/{name}/mean|std`, weighted nansum); DAPO (Yu et al. 2025, arXiv 2503.14476)
eq. 13; GSM8K's `#### answer` convention (Cobbe et al. 2021); MATH's `\boxed{}` (Hendrycks et al. 2021).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import re
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import numpy as np

from posttrain.errors import PosttrainError
from posttrain.rewards.arithmetic import evaluate
from posttrain.rewards.code import run_tests
from posttrain.sandbox import Sandbox

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


@functools.lru_cache(maxsize=1 << 16)  # pure; a batch repeats references and answers
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


@functools.lru_cache(maxsize=1 << 16)  # pure; a batch repeats references and answers
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


@functools.lru_cache(maxsize=1 << 16)  # pure; a batch repeats references and answers
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


def answer_key(text: Any) -> Optional[str]:
    """The voting key of a completion's final answer (maj@k): `extract_answer` with the last-number
    fallback, normalised (`normalize_answer`), numbers as their exact value (`0.5`, `1/2` and
    `\\frac{1}{2}` vote together); None when the completion has no answer."""
    return _answer_key(_text(text))


@functools.lru_cache(maxsize=1 << 16)  # pure; the k samples of a prompt often repeat an answer
def _answer_key(text: str) -> Optional[str]:
    ans = extract_answer(text, last_number=True)
    if ans is None:
        return None
    norm = normalize_answer(ans)
    value = _as_fraction(norm)
    return norm if value is None else str(value)


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


# ----------------------------------------------------------------------------- countdown

def safe_arithmetic(expr: str) -> tuple[Fraction, list[int]]:
    """(exact value, the integer literals in order) of an expression of non-negative decimal
    integers, `+ - * /` and parentheses: `rewards.arithmetic.evaluate`'s strict grammar (anything else,
    or a division by zero, raises ValueError; nothing is ever `eval`-ed)."""
    return evaluate(expr)


def countdown_expression(completion: Any) -> str:
    """The expression a countdown completion states: its first line, and of that the part before
    an `=` (so `25+3*7` and `25+3*7=46` both give `25+3*7`)."""
    text = _text(completion).strip()
    return text.split("\n", 1)[0].split("=", 1)[0].strip()


def _int_list(nums: Any) -> list[int]:
    if isinstance(nums, str):  # "3 7 25" or "3,7,25"
        return [int(n) for n in re.findall(r"\d+", nums)]
    return [int(n) for n in nums]


def countdown_valid(completion: Any, nums: Any, target: Any) -> bool:
    """True when the completion's expression (`countdown_expression`) evaluates exactly to `target`
    and uses each number at most as often as `nums` gives it (not every number need be used)."""
    try:
        val, used = safe_arithmetic(countdown_expression(completion))
    except ValueError:
        return False
    avail: dict[int, int] = {}
    for n in _int_list(nums):
        avail[n] = avail.get(n, 0) + 1
    for n in used:
        if avail.get(n, 0) == 0:
            return False
        avail[n] -= 1
    return val == Fraction(int(target))


def countdown(prompts: Sequence, completions: Sequence, nums: Sequence = None, target: Sequence = None,
              **_) -> list[Optional[float]]:
    """1.0 when the completion is an expression over the row's `nums` (each at most once) equal to its
    `target` (`countdown_valid`), else 0.0; None for a row without nums or target."""
    if nums is None or target is None:
        raise PosttrainError(f"reward 'countdown' needs the columns 'nums' and 'target'; the batch has "
                             f"{sorted(c for c, v in (('nums', nums), ('target', target)) if v is not None)}. "
                             'Give rows like {"prompt": ..., "nums": [3, 7, 25], "target": 46}')
    return [None if n is None or t is None else float(countdown_valid(c, n, t))
            for c, n, t in zip(completions, nums, target, strict=True)]


# ----------------------------------------------------------------------------- code tests

_FENCE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)


def completion_code(completion: Any) -> str:
    """The program a completion states: the body of its last ```python (or ```py) fenced block, else
    the whole text."""
    text = _text(completion)
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


class CodeTests:
    """Runs model-written code against the row's tests: 1.0 when `completion_code(completion)` passes
    the row's `column` (Python: statements and assert statements), else 0.0 (a failed assert, an
    exception, the time or the memory limit, an exit before the tests finished); None for a row with
    empty, missing or non-Python tests.

    Each program runs in `posttrain.sandbox` (an OS boundary: bubblewrap namespaces, a read-only
    system, a private tmpfs, rlimits; `sandbox` picks the mode) with a wall-time limit (`timeout_s`),
    an address-space limit (`memory_mb`) and a 1 MB file-size limit. The asserts' operands come back
    as plain data and are compared in this process (`posttrain.rewards.code`): an object whose
    `__eq__` always returns True fails. Up to `workers` programs run at once (threads waiting on
    subprocesses). Keep the runner's `timeout_s` (GRPO's `reward_timeout_s`) above
    `timeout_s * ceil(batch / workers)`."""

    def __init__(self, column: str = "tests", *, timeout_s: float = 5.0, memory_mb: int = 256,
                 workers: Optional[int] = None, name: str = "code_tests", sandbox: str = "auto"):
        self.box = Sandbox(timeout_s=timeout_s, memory_mb=memory_mb, max_file_mb=1, max_output_bytes=2**20,
                           mode=sandbox)
        self.column, self.workers = column, workers or min(8, os.cpu_count() or 1)
        self.name = self.__name__ = name

    def run(self, code: str, tests: str) -> Optional[bool]:
        """Whether `code` passes `tests` in the sandbox (None: the tests are not Python)."""
        return run_tests(self.box, code, tests)

    def __call__(self, prompts: Sequence, completions: Sequence, **columns) -> list[Optional[float]]:
        if self.column not in columns:
            raise PosttrainError(f"reward {self.name!r} needs the column {self.column!r} (Python tests, e.g. "
                                 f"assert statements); the batch has {sorted(columns)}")

        def one(pair) -> Optional[float]:
            completion, tests = pair
            if tests is None or not str(tests).strip():
                return None
            passed = self.run(completion_code(completion), str(tests))
            return None if passed is None else float(passed)

        pairs = list(zip(completions, columns[self.column], strict=True))
        with ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(pairs)))) as pool:
            return list(pool.map(one, pairs))


def code_tests_reward(column: str = "tests", *, timeout_s: float = 5.0, memory_mb: int = 256,
                      workers: Optional[int] = None, name: str = "code_tests", sandbox: str = "auto") -> CodeTests:
    """A `code_tests` reward with its own tests column, limits, worker count or sandbox mode; see `CodeTests`."""
    return CodeTests(column, timeout_s=timeout_s, memory_mb=memory_mb, workers=workers, name=name, sandbox=sandbox)


def code_tests(prompts: Sequence, completions: Sequence, tests: Sequence = None, **_) -> list[Optional[float]]:
    """The completion's code against the row's `tests` column in posttrain.sandbox (5 s, 256 MB); see `CodeTests`."""
    return CodeTests()(prompts, completions, **({} if tests is None else {"tests": tests}))


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

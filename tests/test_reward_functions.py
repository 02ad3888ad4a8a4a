"""Reward functions: answer extraction and equivalence, the built-ins against TRL's, and the runner's
handling of functions that raise, hang, return NaN, the wrong length or None."""

import math
import threading
import time
import warnings

import numpy as np
import pytest

from posttrain.errors import PosttrainError
from posttrain.rewards import (
    THINK_FORMAT,
    answers_match,
    combine,
    extract_answer,
    format_reward,
    length_reward,
    math_answer,
    math_answer_reward,
    overlong_penalty,
    reward_model_reward,
    reward_names,
    score,
)

# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize("text, expected", [
    (r"so the answer is \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),                       # nested braces
    (r"\boxed{ {a}+\{b\} }", r"{a}+\{b\}"),                         # groups and escaped braces
    (r"first \boxed{1} then \boxed{2}", "2"),                       # the last box
    (r"\boxed{7} and a truncated \boxed{8", "7"),                   # an unclosed box is skipped
    (r"\boxed{\boxed{3}}", "3"),                                    # a wholly boxed box is unwrapped
    (r"\fbox{5}", "5"),
    ("reasoning...\n#### 1,234\nthanks", "1,234"),                  # GSM8K, to the end of the line
    ("#### 1\n#### -72", "-72"),                                    # the last ####
    (r"#### 3 but \boxed{4}", "4"),                                 # \boxed wins over ####
    ("#### \nno answer here 12", None),                             # #### with an empty line: none
    ("the answer is 12", None),                                     # strict: no number fallback
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_last_number_fallback():
    assert extract_answer("it costs 1,000 dollars, or 3/4 of 1,333.5.", last_number=True) == "1,333.5"
    assert extract_answer("x is -7", last_number=True) == "-7"
    assert extract_answer("x is 3/4", last_number=True) == "3/4"
    assert extract_answer("no digits", last_number=True) is None
    assert extract_answer(r"\boxed{9} and then 10", last_number=True) == "9"


@pytest.mark.parametrize("a, b, equal", [
    ("1,000", "1000", True),
    ("1,000,000", "1000000", True),
    ("0.5", "1/2", True),
    (".5", "1/2", True),
    (r"\frac{1}{2}", "0.5", True),
    (r"\dfrac{3}{4}", "0.75", True),
    (r"-\frac{1}{3}", "-1/3", True),
    ("3.0", "3", True),
    ("$18", "18", True),
    (r"\$18.00", "18", True),
    (r"50\%", "50", True),
    (" 42 ", "42", True),
    ("42.", "42", True),
    (r"\text{ 5 }", "5", True),
    ("-72", "72", False),
    ("0.333", "1/3", False),                 # exact: no tolerance
    ("1,2", "12", False),                    # not a thousands comma
    ("1/0", "1/0", True),                    # not a number: the strings are equal
    ("1/0", "2/0", False),
    (r"x^2+1", r"x^2 + 1", True),            # non-numeric: normalised string match
    ("(A)", "(B)", False),
    (r"\left(3\right)", "(3)", True),
    ("1e3", "1000", True),
    ("1e999999999", "2e999999999", False),   # a huge exponent is a string, not a 10**999999999 integer
])
def test_answers_match(a, b, equal):
    assert answers_match(a, b) is equal
    assert answers_match(b, a) is equal


def test_math_answer():
    completions = [
        r"... so \boxed{1,000}",
        "Natalia sold 48/2 = 24 clips in May.\n#### 72",
        "#### 71",
        "I think it is 72",                        # no \boxed, no ####: no answer
        r"\boxed{\frac{1}{2}}",
        r"\boxed{5}",
        r"\boxed{5}",
        [{"role": "assistant", "content": r"\boxed{7}"}],   # a conversation's last message
    ]
    answers = ["1000", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "#### 72", "72", ".5", None, "", 7]
    got = math_answer(prompts=[""] * 8, completions=completions, answer=answers)
    assert got == [1.0, 1.0, 0.0, 0.0, 1.0, None, None, 1.0]
    lenient = math_answer_reward(last_number=True)
    assert lenient(prompts=[""], completions=["I think it is 72"], answer=["72"]) == [1.0]
    other = math_answer_reward(column="solution")
    assert other(prompts=[""], completions=[r"\boxed{2}"], solution=[r"so \boxed{2}"]) == [1.0]
    with pytest.raises(PosttrainError, match="solution"):
        other(prompts=[""], completions=["x"], answer=["1"])


# ----------------------------------------------------------------------------- format, length, overlong


def test_format_matches_trl_think_format_reward():
    from trl.rewards import think_format_reward

    samples = [
        "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
        "<think>\nThis is my reasoning.\nThis is my answer.",
        "<think></think>",
        "<think>a</think>b<think>c</think>",
        "<think>a<think>b</think></think>",
        " <think>a</think>b",
        "\n<think>a</think>b",
        "text <think>a</think>",
        "</think><think>a</think>",
        "<think>line1\nline2</think>\n\nanswer\n",
        "<THINK>a</THINK>",
        "",
    ]
    ours = format_reward(THINK_FORMAT)(prompts=[""] * len(samples), completions=samples)
    trl = think_format_reward([[{"content": s}] for s in samples])
    assert ours == trl
    assert 0.0 < sum(ours) < len(samples)  # the samples exercise both outcomes


def test_format_reward_is_a_full_match():
    f = format_reward(r"\d+", name="digits")
    assert f(prompts=["", "", ""], completions=["123", "123a", "a123"]) == [1.0, 0.0, 0.0]
    assert reward_names([f]) == ["digits"]
    with pytest.raises(PosttrainError, match="not a regex"):
        format_reward("(")


@pytest.mark.parametrize("max_len, cache", [(100, 20), (16, 16), (10, 0), (7, 3)])
def test_overlong_matches_trl_soft_overlong_punishment(max_len, cache):
    from trl.rewards import get_soft_overlong_punishment

    ids = [[1] * n for n in range(0, max_len + 12)]
    ours = overlong_penalty(max_len, cache)(prompts=[""] * len(ids), completions=[""] * len(ids), completion_ids=ids)
    trl = get_soft_overlong_punishment(max_len, cache)(ids)
    assert ours == pytest.approx(trl, abs=0, rel=1e-12)
    assert min(ours) == -1.0 and ours[0] == 0.0


def test_overlong_values_and_errors():
    f = overlong_penalty(100, 20)
    assert f(completion_ids=[[0] * 80, [0] * 90, [0] * 100, [0] * 101]) == [0.0, -0.5, -1.0, -1.0]
    with pytest.raises(PosttrainError, match="completion_ids"):
        f(prompts=[""], completions=["x"])
    with pytest.raises(PosttrainError):
        overlong_penalty(10, 11)


def test_token_lengths_from_a_tokenizer_when_ids_are_absent():
    class WordTokenizer:
        def encode(self, text, add_special_tokens=True):
            return ["<s>"] * add_special_tokens + text.split()

    f = overlong_penalty(4, 2, tokenizer=WordTokenizer())
    texts = ["a b", "a b c", "a b c d", "a b c d e"]
    assert f(prompts=[""] * 4, completions=texts) == [0.0, -0.5, -1.0, -1.0]  # no special tokens counted
    assert f(prompts=[""], completions=["a b c d e"], completion_ids=[[1]]) == [0.0]  # the ids win
    t = length_reward(2, unit="tokens", tokenizer=WordTokenizer())
    assert t(prompts=["", ""], completions=["a b", "a b c"]) == [0.0, -0.5]


def test_length_reward():
    f = length_reward(10)
    assert f(prompts=[""] * 5, completions=["x" * 10, "x" * 5, "x" * 15, "", "x" * 40]) == [0.0, -0.5, -0.5, -1.0, -1.0]
    t = length_reward(4, unit="tokens")
    assert t(prompts=["", ""], completions=["long text", ""], completion_ids=[[1, 2, 3, 4], [1, 2]]) == [0.0, -0.5]
    with pytest.raises(PosttrainError):
        length_reward(0)


def test_reward_model_reward_calls_score():
    class Stub:
        def __init__(self):
            self.calls = []

        def score(self, prompts, completions):
            self.calls.append((prompts, completions))
            return np.array([len(p) + 10 * len(c) for p, c in zip(prompts, completions)], np.float32)

    stub = Stub()
    rewards, keep, stats = score([reward_model_reward(stub)], None, ["a", "bb"], ["x", "yyy"], {})
    assert stub.calls == [(["a", "bb"], ["x", "yyy"])]
    np.testing.assert_array_equal(rewards[:, 0], [11.0, 32.0])
    assert stats["rewards/reward_model/mean"] == 21.5


# ----------------------------------------------------------------------------- the runner


def ones(prompts, completions, **_):
    return [1.0] * len(completions)


def halves_or_none(prompts, completions, **_):
    return [None if c == "skip" else 0.5 * i for i, c in enumerate(completions)]


def raises(prompts, completions, **_):
    raise ValueError("boom")


def sleeps(prompts, completions, **_):
    time.sleep(5)
    return [1.0] * len(completions)


def nan_at_1(prompts, completions, **_):
    return [0.0, float("nan"), 2.0, float("inf")]


def not_a_number_at_0(prompts, completions, **_):
    return ["high", 1.0, np.float32(2.0), True]


def wrong_length(prompts, completions, **_):
    return [1.0]


def returns_scalar(prompts, completions, **_):
    return 1.0


P, C = ["p0", "p1", "p2", "p3"], ["c0", "skip", "c2", "c3"]


def run(funcs, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return score(funcs, None, P, C, {"answer": ["1", "2", "3", "4"]}, **kw)


def test_runner_happy_path_columns_and_none():
    seen = {}

    def spy(prompts, completions, answer, **rest):
        seen.update(prompts=prompts, completions=completions, answer=answer, rest=rest)
        prompts.append("mutated")  # each function gets its own copies
        return [float(a) for a in answer]

    rewards, keep, stats = score([spy, halves_or_none, ones], [1.0, 2.0, 0.5], P, C, {"answer": ["1", "2", "3", "4"]})
    assert seen == {"prompts": P + ["mutated"], "completions": C, "answer": ["1", "2", "3", "4"], "rest": {}}
    assert P == ["p0", "p1", "p2", "p3"]
    np.testing.assert_array_equal(rewards, [[1, 0, 1], [2, np.nan, 1], [3, 1.0, 1], [4, 1.5, 1]])
    assert keep.all()
    assert stats["rewards/halves_or_none/mean"] == pytest.approx(2.5 / 3)                # None excluded
    assert stats["rewards/halves_or_none/std"] == pytest.approx(np.std([0, 1, 1.5], ddof=1))
    assert stats["rewards/spy/errors"] == stats["rewards/spy/timeouts"] == stats["rewards/spy/nonfinite"] == 0
    totals = combine(rewards, [1.0, 2.0, 0.5])
    np.testing.assert_allclose(totals, [1.5, 2.5, 5.5, 7.5])
    assert stats["reward"] == pytest.approx(totals.mean())
    assert stats["rewards/dropped"] == 0


def test_combine_all_none_row_is_nan():
    totals = combine(np.array([[np.nan, np.nan], [1.0, np.nan]]), [2.0, 3.0])
    assert math.isnan(totals[0]) and totals[1] == 2.0


@pytest.mark.parametrize("on_error", ["zero", "drop"])
def test_runner_raising_function(on_error):
    rewards, keep, stats = run([ones, raises], on_error=on_error)
    assert stats["rewards/raises/errors"] == 1 and stats["rewards/raises/timeouts"] == 0
    assert math.isnan(stats["rewards/raises/mean"])
    np.testing.assert_array_equal(rewards[:, 0], 1.0)
    if on_error == "zero":
        np.testing.assert_array_equal(rewards[:, 1], 0.0)
        assert keep.all() and stats["rewards/dropped"] == 0
    else:
        assert np.isnan(rewards[:, 1]).all()
        assert not keep.any() and stats["rewards/dropped"] == 4


def test_runner_raise_is_warned_and_not_fatal_without_timeout():
    with pytest.warns(RuntimeWarning, match="raises.*ValueError: boom"):
        rewards, keep, stats = score([raises], None, P, C, None)
    assert stats["rewards/raises/errors"] == 1


@pytest.mark.parametrize("on_error", ["zero", "drop"])
def test_runner_hanging_function_times_out(on_error):
    before = threading.active_count()
    t0 = time.perf_counter()
    rewards, keep, stats = run([sleeps, ones], timeout_s=0.2, on_error=on_error)
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.8, elapsed
    assert stats["rewards/sleeps/timeouts"] == 1 and stats["rewards/sleeps/errors"] == 0
    assert stats["rewards/abandoned_threads"] >= 1
    assert threading.active_count() > before  # the stuck call is left running, not joined
    np.testing.assert_array_equal(rewards[:, 1], 1.0)  # the next function still ran
    if on_error == "zero":
        np.testing.assert_array_equal(rewards[:, 0], 0.0)
        assert keep.all()
    else:
        assert np.isnan(rewards[:, 0]).all() and not keep.any()
    # a fast function under a timeout gives its values
    rewards, keep, stats = run([ones], timeout_s=0.2)
    np.testing.assert_array_equal(rewards[:, 0], 1.0)
    assert stats["rewards/ones/timeouts"] == 0


def test_runner_timeout_thread_catches_raise():
    rewards, keep, stats = run([raises], timeout_s=1.0)
    assert stats["rewards/raises/errors"] == 1 and stats["rewards/raises/timeouts"] == 0


@pytest.mark.parametrize("on_error", ["zero", "drop"])
def test_runner_nonfinite_values(on_error):
    rewards, keep, stats = run([nan_at_1, not_a_number_at_0], on_error=on_error)
    assert stats["rewards/nan_at_1/nonfinite"] == 2 and stats["rewards/nan_at_1/errors"] == 0
    assert stats["rewards/not_a_number_at_0/nonfinite"] == 1
    assert stats["rewards/nan_at_1/mean"] == 1.0                       # over the valid 0 and 2
    assert stats["rewards/not_a_number_at_0/mean"] == pytest.approx(4 / 3)  # 1, 2, True
    if on_error == "zero":
        np.testing.assert_array_equal(rewards, [[0, 0], [0, 1], [2, 2], [0, 1]])
        assert keep.all()
    else:
        np.testing.assert_array_equal(rewards, [[0, np.nan], [np.nan, 1], [2, 2], [np.nan, 1]])
        np.testing.assert_array_equal(keep, [False, False, True, False])
        assert stats["rewards/dropped"] == 3


@pytest.mark.parametrize("func", [wrong_length, returns_scalar])
@pytest.mark.parametrize("on_error", ["zero", "drop"])
def test_runner_wrong_result(func, on_error):
    rewards, keep, stats = run([func], on_error=on_error)
    assert stats[f"rewards/{func.__name__}/errors"] == 1
    if on_error == "zero":
        np.testing.assert_array_equal(rewards[:, 0], 0.0)
        assert keep.all()
    else:
        assert not keep.any()


def test_runner_names_and_stats_keys():
    f = format_reward(r"c\d")
    rewards, keep, stats = run([ones, ones, f, lambda prompts, completions, **_: [0.0] * 4])
    names = ["ones", "ones_2", "format_reward", "<lambda>"]
    assert reward_names([ones, ones, f, lambda: 0]) == names
    assert reward_names([ones, ones, type("X", (), {"name": "ones_2"})()]) == ["ones", "ones_2", "ones_2_2"]
    expected = {f"rewards/{n}/{k}" for n in names for k in ("mean", "std", "errors", "timeouts", "nonfinite")}
    assert set(stats) == expected | {"reward", "rewards/dropped", "rewards/abandoned_threads"}
    np.testing.assert_array_equal(rewards[:, 2], [1, 0, 1, 1])


def test_runner_bad_arguments_are_clear_errors():
    with pytest.raises(PosttrainError, match="on_error"):
        score([ones], None, P, C, None, on_error="ignore")
    with pytest.raises(PosttrainError, match="column 'answer'"):
        score([ones], None, P, C, {"answer": ["1"]})
    with pytest.raises(PosttrainError, match="weights"):
        score([ones], [1.0, 2.0], P, C, None)
    with pytest.raises(PosttrainError, match="completions"):
        score([ones], None, P, C[:2], None)
    with pytest.raises(PosttrainError, match="timeout_s"):
        score([ones], None, P, C, None, timeout_s=0)


def test_runner_with_trl_reward_function():
    from trl.rewards import get_soft_overlong_punishment

    ids = [[1] * 5, [1] * 9, [1] * 10, [1] * 11]
    rewards, keep, stats = score([get_soft_overlong_punishment(10, 4)], None, P, C, {"completion_ids": ids})
    np.testing.assert_allclose(rewards[:, 0], [0.0, -0.75, -1.0, -1.0])
    assert "rewards/soft_overlong_punishment_reward/mean" in stats

"""Built-in tasks (posttrain/tasks): held-out splits, verifiers, countdown's solutions and its safe
reward, the difficulty knob, seeding."""

import collections
import re
from fractions import Fraction

import pytest

from posttrain import rewards as R
from posttrain import tasks
from posttrain.errors import PosttrainError
from posttrain.tasks import addition, arithmetic, countdown

SMALL = {"addition": {}, "arithmetic": {"n_train": 400}, "countdown": {"n_train": 400}}


def _make(name, difficulty=2, seed=0, n_eval=50):
    if name == "addition" and difficulty == 1:
        n_eval = min(n_eval, 40)  # 1-digit addition has 55 problems (up to order)
    return tasks.make(name, difficulty=difficulty, seed=seed, n_eval=n_eval, **SMALL[name])


def _key(name, prompt):
    """An instance's identity up to reordering, read back from its prompt alone."""
    if name == "countdown":
        m = re.fullmatch(r"nums ([\d ]+) target (\d+):", prompt)
        return tuple(sorted(int(n) for n in m.group(1).split())), int(m.group(2))
    terms = re.findall(r"([+-]?)(\d+)", prompt.rstrip("="))
    return tuple(sorted((-1 if sign == "-" else 1, int(n)) for sign, n in terms))


@pytest.mark.parametrize("name", ["addition", "arithmetic", "countdown"])
def test_rows_have_the_trl_shapes(name):
    d = _make(name)
    assert d.name == name and len(d.sft_eval) == len(d.eval_prompts) == len(d.eval_pairs) == 50
    assert len(d.sft_train) == len(d.prompts) == len(d.pairs) > 0
    cols = {"countdown": {"prompt", "nums", "target"}}.get(name, {"prompt", "answer"})
    for rows, keys in ((d.sft_train + d.sft_eval, {"prompt", "completion"}), (d.prompts + d.eval_prompts, cols),
                       (d.pairs + d.eval_pairs, {"prompt", "chosen", "rejected"})):
        assert all(set(r) == keys and isinstance(r["prompt"], str) for r in rows)
    # The rows of one split describe the same instances, in the same order.
    assert [r["prompt"] for r in d.sft_train] == [r["prompt"] for r in d.prompts] == [r["prompt"] for r in d.pairs]
    assert [r["completion"] for r in d.sft_train] == [r["chosen"] for r in d.pairs]


@pytest.mark.parametrize("name", ["addition", "arithmetic", "countdown"])
def test_held_out_split_is_disjoint_from_every_training_row(name):
    for difficulty in ((1, 2) if name == "addition" else (1, 3, 5)):
        d = _make(name, difficulty)
        train = {_key(name, r["prompt"]) for rows in (d.sft_train, d.prompts, d.pairs) for r in rows}
        held = [_key(name, r["prompt"]) for r in d.sft_eval]
        assert len(set(held)) == len(held)  # no duplicates inside the held-out split either
        assert not train & set(held), f"{name} level {difficulty}: held-out instances seen in training"
        if name != "addition":  # (addition trains on both a+b and b+a, as make_pairs always did)
            assert len(train) == len(d.sft_train)  # none repeated in training


def test_addition_task_is_make_pairs():
    d = tasks.make("addition", difficulty=2, seed=3, n_eval=100)
    train, held = addition.make_pairs(2, 3, 100)
    assert d.sft_train == train and d.sft_eval == held
    assert d.prompts[0] == {"prompt": train[0]["prompt"], "answer": train[0]["completion"]}


@pytest.mark.parametrize("name", ["addition", "arithmetic", "countdown"])
def test_verifier_accepts_references_and_rejects_wrong_answers(name):
    d = _make(name, 3 if name != "addition" else 2)
    for row, sft, pair in zip(d.eval_prompts + d.prompts, d.sft_eval + d.sft_train, d.eval_pairs + d.pairs):
        assert d.verify(row, sft["completion"]), (row, sft)
        assert not d.verify(row, pair["rejected"]), (row, pair)
        assert not d.verify(row, "") and not d.verify(row, "no idea")
    # The GRPO reward the task names makes the same call as its verifier.
    rows = d.eval_prompts
    comps = [r["completion"] for r in d.sft_eval]
    wrong = [p["rejected"] for p in d.eval_pairs]
    if d.reward == "last_number":
        fn = R.math_answer_reward(last_number=True)
        cols = {"answer": [r["answer"] for r in rows]}
    else:
        fn = R.countdown
        cols = {"nums": [r["nums"] for r in rows], "target": [r["target"] for r in rows]}
    prompts = [r["prompt"] for r in rows]
    assert fn(prompts, comps, **cols) == [1.0] * len(rows)
    assert fn(prompts, wrong, **cols) == [0.0] * len(rows)


def test_arithmetic_verifier_reads_the_final_number():
    row = {"prompt": "48+75-9=", "answer": "114"}
    assert arithmetic.verify(row, "114") and arithmetic.verify(row, "48+75=123, 123-9=114")
    assert not arithmetic.verify(row, "113") and not arithmetic.verify(row, "114 or 115")
    assert arithmetic.verify({"prompt": "3-8=", "answer": "-5"}, "-5") and not arithmetic.verify(
        {"prompt": "3-8=", "answer": "-5"}, "5")


def _plain_value(expr):
    """An independent evaluation of a reference solution: after checking that it is only digits,
    operators and parentheses, Python's own arithmetic (a test-side reference, not the verifier)."""
    assert re.fullmatch(r"[0-9+\-*/()]+", expr), expr
    return eval(expr, {"__builtins__": {}})  # noqa: S307 - digits and operators only, checked above


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5])
def test_countdown_solutions_are_valid(level):
    d = tasks.make("countdown", difficulty=level, seed=level, n_eval=50, n_train=300)
    p = countdown.LEVELS[level]
    for sft, row in zip(d.sft_train + d.sft_eval, d.prompts + d.eval_prompts):
        expr, nums, target = sft["completion"], row["nums"], row["target"]
        assert row["prompt"] == f"nums {' '.join(map(str, nums))} target {target}:"
        assert len(nums) == p["count"] and all(1 <= n <= p["max_value"] for n in nums)
        used = collections.Counter(int(n) for n in re.findall(r"\d+", expr))
        assert not used - collections.Counter(nums), (expr, nums)  # each number at most as often as given
        if p.get("use_all"):
            assert sum(used.values()) == len(nums)
        assert set(re.findall(r"[+\-*/]", expr)) <= set(p["ops"])
        assert abs(_plain_value(expr) - target) < 1e-9 and 1 <= target <= countdown.DEFAULTS["max_target"]
        assert target not in nums  # not solved by copying a number
        assert R.safe_arithmetic(expr)[0] == Fraction(target)


def test_countdown_verifier_rules():
    row = {"nums": [3, 7, 25], "target": 46}
    ok = ["25+3*7", "3*7+25", "(7*3)+25", "25 + 3 * 7", "25+3*7=46", "25+3*7\nbecause 3*7 is 21"]
    for c in ok:
        assert countdown.verify(row, c), c
    bad = ["25+21", "25+3*7+0", "25+3*7*1", "25+25-4", "7*7-3", "46", "25+3*7-7+7", "", "25+3*"]
    for c in bad:
        assert not countdown.verify(row, c), c
    assert countdown.verify({"nums": [7, 7, 2], "target": 7}, "7/7*7") is False  # 7 given twice, used 3 times
    assert countdown.verify({"nums": [2, 7, 7], "target": 7}, "7/2*2") is False  # 2 given once
    assert countdown.verify({"nums": [2, 2, 7], "target": 7}, "7/2*2")  # exact: non-integer steps are fine
    assert countdown.verify({"nums": "3 7 25", "target": "46"}, "25+3*7")  # columns read back as strings


def test_countdown_reward_rejects_unsafe_input(tmp_path):
    marker = tmp_path / "pwned"
    nasty = ["__import__('os')", f"__import__('os').system('touch {marker}')", "().__class__.__bases__",
             "open('/etc/passwd').read()", "lambda: 1", "2**100", "9**9**9**9", "-3+49", "+46", "1e3",
             "0x19+21", "46.0", "25+3*7 if 1 else 0", "[25][0]+21", "25+3*7;0", "(" * 150 + "46" + ")" * 150,
             "4" + "6" * 300, "25/(7-7)+46", "٤٦"]
    nums, target = [3, 7, 25, 46, 4, 6, 21, 19, 49, 3], 46
    out = R.countdown(["p"] * len(nasty), nasty, nums=[nums] * len(nasty), target=[target] * len(nasty))
    assert out == [0.0] * len(nasty)
    assert not marker.exists()
    for expr in nasty:
        with pytest.raises(ValueError):
            R.safe_arithmetic(expr)
    assert R.safe_arithmetic("(25-4)*2/7") == (Fraction(6), [25, 4, 2, 7])
    # No reference for a row -> None; missing columns -> a clear error.
    assert R.countdown(["p", "q"], ["46", "46"], nums=[None, [46]], target=[46, 46]) == [None, 1.0]
    with pytest.raises(PosttrainError, match="'nums' and 'target'"):
        R.countdown(["p"], ["46"], answer=["46"])


def test_countdown_is_a_named_grpo_reward():
    from posttrain.rewards.registry import reward_functions
    from posttrain.trainers.grpo import GRPOSection

    funcs, weights = reward_functions(GRPOSection(rewards={"countdown": 1.0, "last_number": 0.5}), None)
    assert funcs[0] is R.countdown and weights == [1.0, 0.5]


def test_difficulty_changes_the_instances():
    easy, hard = _make("countdown", 1), _make("countdown", 4)
    assert {len(r["nums"]) for r in easy.prompts} == {3} and {len(r["nums"]) for r in hard.prompts} == {5}
    assert max(max(r["nums"]) for r in easy.prompts) <= 20 < max(max(r["nums"]) for r in hard.prompts)
    assert any("*" in r["completion"] for r in hard.sft_train) and not any("*" in r["completion"]
                                                                             for r in easy.sft_train)
    for level, p in arithmetic.LEVELS.items():
        d = _make("arithmetic", level)
        for r in d.sft_train[:200]:
            terms = re.findall(r"([+-]?)(\d+)", r["prompt"].rstrip("="))
            assert len(terms) == p["operands"]
            assert all(len(n) == p["digits"] for _, n in terms)
            assert {s for s, _ in terms[1:]} <= set(p["ops"])
            value, carried = int(terms[0][1]), 0
            for sign, n in terms[1:]:
                carried += arithmetic.carries(value, int(n), sign)
                value = value + int(n) if sign == "+" else value - int(n)
            assert carried >= p["min_carries"] and str(value) == r["completion"]
    # Knobs by name override a level's defaults; unknown knobs and levels are errors.
    d = tasks.make("countdown", difficulty={"count": 4, "max_value": 9, "ops": "+"}, n_eval=10, n_train=50)
    assert all(len(r["nums"]) == 4 and max(r["nums"]) <= 9 for r in d.prompts)
    assert all(set(re.findall(r"[+\-*/]", r["completion"])) == {"+"} for r in d.sft_train)
    with pytest.raises(PosttrainError, match="unknown difficulty knobs"):
        tasks.make("arithmetic", difficulty={"digitz": 3})
    with pytest.raises(PosttrainError, match="level 9"):
        tasks.make("countdown", difficulty=9)
    with pytest.raises(PosttrainError, match="unknown task 'sudoku'"):
        tasks.make("sudoku")
    with pytest.raises(PosttrainError, match="distinct instances"):  # 1-digit a+b has only 55 problems
        tasks.make("arithmetic", difficulty={"digits": 1}, n_eval=50, n_train=100)


def test_carries_by_hand():
    assert arithmetic.carries(57, 68, "+") == 2  # 7+8 carries, 5+6+1 carries
    assert arithmetic.carries(12, 34, "+") == 0
    assert arithmetic.carries(100, 1, "-") == 2  # borrows through both zeros
    assert arithmetic.carries(5, 17, "-") == 0  # 17-5: no borrow
    assert arithmetic.carries(-15, 7, "-") == 1  # -(15+7): one carry


@pytest.mark.parametrize("name", ["addition", "arithmetic", "countdown"])
def test_same_seed_same_rows_other_seed_other_rows(name):
    level = 1 if name == "addition" else 2  # (2-digit addition is ~10k rows: slow to build thrice)
    a, b, c = _make(name, level, seed=5), _make(name, level, seed=5), _make(name, level, seed=6)
    for field in ("sft_train", "sft_eval", "prompts", "eval_prompts", "pairs", "eval_pairs"):
        assert getattr(a, field) == getattr(b, field)
    assert a.sft_eval != c.sft_eval and a.sft_train != c.sft_train

"""posttrain.evals: pass@k against the exact combinatorial formula, maj@k's documented tie rule, the
bootstrap interval's coverage, and the sampled evaluation on a tiny model against a hand count."""

import itertools
import json
import math
import os

import numpy as np
import pytest

from posttrain.evals import bootstrap_interval, maj_at_k, pass_at_k, summarize
from posttrain.rewards.functions import answer_key


def exact_pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) with Python's exact integers and fractions."""
    from fractions import Fraction

    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def enumerated_pass_at_k(correct: list[bool], k: int) -> float:
    """The fraction of all k-subsets of the samples that hold a correct one (the definition itself)."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_the_exact_formula_on_hand_made_matrices():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 8, 16, 40):
        matrix = rng.random((30, n)) < rng.random((30, 1))  # prompts x samples, varied success rates
        c = matrix.sum(1)
        for k in sorted({1, min(2, n), n // 2 or 1, n}):
            got = pass_at_k(n, c, k)
            want = np.array([exact_pass_at_k(n, int(ci), k) for ci in c])
            assert got.dtype == np.float64 and np.max(np.abs(got - want)) <= 1e-12, (n, k)
            if n <= 8:
                brute = np.array([enumerated_pass_at_k(list(row), k) for row in matrix])
                assert np.max(np.abs(got - brute)) <= 1e-12
    assert pass_at_k(10, 0, 3) == 0.0 and pass_at_k(10, 8, 3) == 1.0  # scalars stay scalars
    assert isinstance(pass_at_k(10, 3, 1), float) and pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-15)
    for bad in ((4, 1, 5), (4, 5, 1), (4, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_maj_at_k_votes_and_shares_ties_as_documented():
    keys = [["4", "4", "5", None],   # 4 wins 2-1, and it is right
            ["4", "5", "5", "5"],    # 5 wins, wrong
            ["4", "5", None, None],  # a 1-1 tie between a right and a wrong answer: 0.5
            [None, None, None, None],  # nobody answered: 0
            ["7", "8", "9", "7"]]    # 7 wins, the correctness of the samples that said 7
    correct = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(maj_at_k(keys, correct), [1.0, 0.0, 0.5, 0.0, 0.0])
    # three-way tie, two of them right: 2/3
    assert maj_at_k([["a", "b", "c"]], np.array([[1, 1, 0]], bool))[0] == pytest.approx(2 / 3)


def test_answer_keys_vote_by_value():
    assert answer_key("so it is 1/2") == answer_key("\\boxed{0.5}") == answer_key("#### .5")
    assert answer_key("12") != answer_key("13")
    assert answer_key("no number here") is None


@pytest.mark.parametrize("metric", ["pass@1", "pass@8"])
def test_bootstrap_interval_covers_the_true_value(metric):
    """200 simulated evaluations of 100 prompts x 8 samples, each prompt with its own success rate p from a
    fixed population: the 95 % interval holds the population's true pass@1 / pass@8 in >= 90 % of them."""
    rng = np.random.default_rng(1)
    population = rng.beta(0.6, 0.9, 100_000)
    truth = {"pass@1": population.mean(), "pass@8": (1 - (1 - population) ** 8).mean()}[metric]
    covered = 0
    for run in range(200):
        p = rng.choice(population, 100)
        correct = rng.random((100, 8)) < p[:, None]
        summary = summarize(correct, correct.astype(float), np.ones((100, 8)), [[None] * 8] * 100, seed=run)
        lo, hi = summary[metric][1]
        covered += lo <= truth <= hi
    print(f"bootstrap 95 % interval of {metric}: covers the truth in {covered} of 200 runs")
    assert covered >= 180, covered


def test_bootstrap_interval_of_a_constant_is_a_point_and_nan_values_are_left_out():
    assert bootstrap_interval([0.5] * 20) == (0.5, 0.5)
    lo, hi = bootstrap_interval([1.0, 0.0, float("nan")] * 10)
    assert 0.2 < lo < 0.5 < hi < 0.8
    assert all(math.isnan(x) for x in bootstrap_interval([float("nan")]))


# ----------------------------------------------------------------------------- on a tiny model

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = os.path.join(HERE, "data", "grpo_addition.jsonl")


def parity_reward(prompts, completions, **_):
    """1 for a completion of an even number of characters: a mix of right and wrong for a random model."""
    return [float(len(c) % 2 == 0) for c in completions]


def scripted_reward(prompts, completions, **_):
    """The same reward for every sample, changing by call: 0.3, 0.9, 0.1, 0.1, ... (the 2nd evaluation is best)."""
    scripted_reward.calls = getattr(scripted_reward, "calls", 0) + 1
    return [{1: 0.3, 2: 0.9}.get(scripted_reward.calls, 0.1)] * len(completions)


def test_sampled_eval_equals_a_hand_count_of_the_same_samples():
    import jax
    from flax import nnx

    from posttrain.data.prompts import eval_prompts
    from posttrain.evals import SampledEval
    from posttrain.generate import Sampler, SamplingParams
    from posttrain.models import Transformer, preset
    from posttrain.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    model = Transformer(preset("demo-tiny", vocab_size=tok.vocab_size), rngs=nnx.Rngs(3))
    prompts = eval_prompts(PROMPTS, tok, max_prompt_length=8, limit=24)
    k = 4
    ev = SampledEval(prompts, tok, [parity_reward], [1.0], k=k, max_new_tokens=6, temperature=1.0, seed=5,
                     prompts_per_call=24)
    summary, _ = ev.run(model)
    # by hand: the same sampler call, the reward applied directly, the metrics counted with plain Python
    out = Sampler(model, max_len=16, pad_id=tok.pad_id).generate(
        [p.ids for p in prompts], SamplingParams(max_new_tokens=6, temperature=1.0, n=k, stop_ids=tok.eos_ids),
        key=jax.random.fold_in(jax.random.key(5), 0))
    texts = out.texts(tok)
    right = [[len(texts[i * k + j]) % 2 == 0 for j in range(k)] for i in range(len(prompts))]
    assert 0 < sum(map(sum, right)) < k * len(prompts)  # a mix, or the test would prove little
    assert summary["pass@1"][0] == pytest.approx(np.mean([sum(r) / k for r in right]), abs=1e-12)
    assert summary[f"pass@{k}"][0] == pytest.approx(np.mean([any(r) for r in right]), abs=1e-12)
    assert summary["reward"][0] == pytest.approx(np.mean(right), abs=1e-12)
    assert summary["length"][0] == pytest.approx(out.lengths.mean(), abs=1e-12)
    from collections import Counter

    maj = []
    for i, r in enumerate(right):
        keys = [answer_key(t) for t in texts[i * k:(i + 1) * k]]
        votes = Counter(key for key in keys if key is not None)
        if not votes:
            maj.append(0.0)
            continue
        top = max(votes.values())
        won = [key for key, v in votes.items() if v == top]
        maj.append(np.mean([r[keys.index(key)] for key in won]))
    assert summary[f"maj@{k}"][0] == pytest.approx(np.mean(maj), abs=1e-12)
    for value, (lo, hi) in summary.values():
        assert lo <= value <= hi


def grpo_config(tmp_path, name: str, steps: int, **over):
    from conftest import nested

    from posttrain import config as C
    from posttrain.trainers.grpo import GRPOConfig

    d = {"model": {"preset": "demo-tiny"},
         "data": {"train": PROMPTS, "eval": PROMPTS, "max_prompt_length": 8},
         # parity: a reward a random model gets right half the time, so every step moves the weights
         "grpo": {"num_generations": 4, "max_new_tokens": 4, "rewards": {"test_evals:parity_reward": 1.0}},
         "lora": {"enabled": True, "rank": 4}, "optim": {"lr": 1e-2, "schedule": "constant"},
         "train": {"steps": steps, "batch_size": 4, "log_every": 1, "eval_every": 2},
         "eval": {"k": 4, "max_prompts": 16, "rewards": {"test_evals:scripted_reward": 1.0}},
         "checkpoint": {"keep": 1, "best_metric": "eval_reward"},
         "metrics": {"sinks": ["jsonl"]}, "run_dir": str(tmp_path / name)}
    nested(d, over)
    return C.from_dict(GRPOConfig, d)


def test_grpo_evaluates_in_the_loop_keeps_the_best_step_and_exports_it(tmp_path, capsys):
    """eval_pass@1 / pass@4 / maj@4 / reward / length logged every 2 steps; the best evaluation (step 4,
    scripted) is checkpointed although checkpoint.every is 0 and kept beside the newest one (keep=1);
    `export --best` writes step 4's weights: those of the same run stopped at step 4."""
    from safetensors.numpy import load_file

    from posttrain import cli
    from posttrain.trainers.grpo import GRPOTrainer

    scripted_reward.calls = 0
    GRPOTrainer(grpo_config(tmp_path, "run", 6), progress=False).train()
    run = tmp_path / "run"
    evals = [r for r in map(json.loads, open(run / "metrics.jsonl")) if "eval_pass@1" in r]
    assert [r["step"] for r in evals] == [2, 4, 6]
    assert [r["eval_reward"] for r in evals] == pytest.approx([0.3, 0.9, 0.1])
    for r in evals:
        assert {"eval_pass@4", "eval_maj@4", "eval_length"} <= set(r) and 0 <= r["eval_maj@4"] <= 1
    assert sorted(int(d) for d in os.listdir(run / "checkpoints") if d.isdigit()) == [4, 6]
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "best"), "--best"]) == 0
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "last")]) == 0
    scripted_reward.calls = 0
    GRPOTrainer(grpo_config(tmp_path, "run4", 4), progress=False).train()
    assert cli.main(["export", "--run", str(tmp_path / "run4"), "--out", str(tmp_path / "four")]) == 0
    weights = lambda name: load_file(str(tmp_path / name / "model.safetensors"))  # noqa: E731
    best, four, last = weights("best"), weights("four"), weights("last")
    assert all(np.array_equal(best[key], four[key]) for key in best)
    assert not all(np.array_equal(best[key], last[key]) for key in best)  # steps 5 and 6 moved the weights

    # the same run evaluated from the command line (its best checkpoint), the JSON in the run folder
    capsys.readouterr()
    assert cli.main(["eval", "--run", str(run), "--best", "--data", PROMPTS, "--reward", "test_evals:parity_reward",
                     "--k", "4", "--max-new-tokens", "4", "--max-prompts", "8"]) == 0
    record = json.load(open(run / "eval.json"))
    assert record["prompts"] == 8 and record["best"] and set(record["metrics"]) == {
        "pass@1", "pass@4", "maj@4", "reward", "length"}
    assert "pass@1" in capsys.readouterr().out

    # compare: one table with both runs, one PNG; a pipeline page with both stages' evaluation curves
    assert cli.main(["compare", str(run), str(tmp_path / "run4"), "--out", str(tmp_path / "cmp.png")]) == 0
    table = capsys.readouterr().out
    assert "run4" in table and "eval_pass@1" in table
    assert open(tmp_path / "cmp.png", "rb").read(4) == b"\x89PNG"
    from posttrain.report import write_pipeline_report

    page = open(write_pipeline_report(str(tmp_path), [("first", str(run)), ("second", str(tmp_path / "run4"))])).read()
    assert page.count("<h2>Stage ") == 2 and page.count("data:image/png;base64") >= 4


@pytest.mark.parametrize("over, words", [
    ({"eval.k": 4, "data.eval": None, "train.eval_every": 0}, "eval.k is set but data.eval is not"),
    ({"eval.k": 0}, "set eval.k"),
    ({"checkpoint.best_metric": "eval_pass@1", "data.eval": None, "train.eval_every": 0, "eval.k": 0},
     "checkpoint.best_metric is set but data.eval is not")])
def test_sampled_eval_settings_are_checked_before_anything_runs(tmp_path, over, words):
    from posttrain.errors import PosttrainError
    from posttrain.trainers.grpo import GRPOTrainer

    with pytest.raises(PosttrainError, match=words):
        GRPOTrainer(grpo_config(tmp_path, "bad", 2, **over), progress=False)
    assert not (tmp_path / "bad").exists()


def test_eval_cli_names_a_bad_row_and_exits_2(tmp_path, capsys):
    from posttrain import cli

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "no prompt"}\n')
    hf = tmp_path / "hf"
    from flax import nnx

    from posttrain.models import Transformer, preset, save_pretrained
    from posttrain.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    save_pretrained(Transformer(preset("demo-tiny", vocab_size=tok.vocab_size), rngs=nnx.Rngs(0)), str(hf),
                    tokenizer=tok)
    assert cli.main(["eval", "--model", str(hf), "--data", str(bad), "--k", "2"]) == 2
    assert f"{bad}:2" in capsys.readouterr().err


def test_sft_logs_its_loss_and_sampled_evaluation_of_the_same_held_out_rows(tmp_path):
    from posttrain import config as C
    from posttrain.trainers.sft import SFTTrainer

    data = os.path.join(HERE, "data", "sft_prompt_completion.jsonl")
    cfg = C.from_dict(C.SFTConfig, {
        "model": {"preset": "demo-tiny"}, "data": {"train": data, "eval": data, "max_length": 16},
        "train": {"steps": 2, "batch_size": 2, "log_every": 1, "eval_every": 1},
        "eval": {"k": 3, "max_new_tokens": 3}, "metrics": {"sinks": ["jsonl"]}, "run_dir": str(tmp_path / "sft")})
    SFTTrainer(cfg, progress=False).train()
    evals = [r for r in map(json.loads, open(tmp_path / "sft" / "metrics.jsonl")) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2]
    assert all({"eval_pass@1", "eval_pass@3", "eval_maj@3"} <= set(r) for r in evals)


def test_held_out_rows_of_every_trainer_become_prompts_with_their_reference_answer():
    from posttrain.data.prompts import as_prompt_row

    assert as_prompt_row({"prompt": "2+2=", "completion": "4"}, "f:1")["answer"] == "4"
    assert as_prompt_row({"prompt": "q", "chosen": "yes", "rejected": "no"}, "f:1")["answer"] == "yes"
    assert as_prompt_row({"prompt": "q", "completion": "x", "answer": "7"}, "f:1")["answer"] == "7"
    chat = as_prompt_row({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                       {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
                         "f:1")
    assert chat["answer"] == "d" and [m["content"] for m in chat["prompt"]] == ["a", "b", "c"]
    from posttrain.errors import PosttrainError

    with pytest.raises(PosttrainError, match="f:3: the conversation has no assistant turn"):
        as_prompt_row({"messages": [{"role": "user", "content": "a"}]}, "f:3")

"""Pipeline / `posttrain run`: a chain equals the single-trainer CLI calls, resumes at the stage, and
rejects bad pipeline files with a message naming the file:line, the stage and the key."""

import json
import os

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from posttrain import cli
from posttrain.errors import PosttrainError
from posttrain.pipeline import Pipeline

SFT = {"model": {"preset": "tiny-student"}, "data": {"train": "tests/data/sft_prompt_completion.jsonl",
                                                      "max_length": 32},
       "optim": {"lr": 1e-3, "schedule": "constant"}, "train": {"steps": 3, "batch_size": 2, "log_every": 1},
       "metrics": {"sinks": ["jsonl"]}}
DPO = {"data": {"train": "PAIRS", "max_length": 48}, "lora": {"enabled": True, "rank": 4},
       "optim": {"lr": 1e-3, "schedule": "constant"}, "train": {"steps": 2, "batch_size": 4, "log_every": 1},
       "metrics": {"sinks": ["jsonl"]}}


def _weights(run_dir):
    return load_file(os.path.join(run_dir, "trainable.safetensors"))


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _write(path, obj):
    with open(path, "w") as fh:
        yaml.safe_dump(obj, fh)
    return str(path)


def test_chain_equals_single_trainer_calls_and_resumes_at_the_stage(tmp_path):
    pairs = str(tmp_path / "pairs.jsonl")
    dpo = json.loads(json.dumps(DPO).replace("PAIRS", pairs))
    # The single-trainer CLI calls: sft, export, dpo from the export.
    assert cli.main(["sft", "--config", _write(tmp_path / "sft.yaml", dict(SFT, run_dir=str(tmp_path / "a/sft")))]) == 0
    assert cli.main(["export", "--run", str(tmp_path / "a/sft"), "--out", str(tmp_path / "a/sft_hf")]) == 0
    with open("tests/data/pref_tiny.jsonl") as src, open(pairs, "w") as dst:
        dst.write(src.read())
    dpo_a = dict(dpo, model={"path": str(tmp_path / "a/sft_hf")}, run_dir=str(tmp_path / "a/dpo"))
    assert cli.main(["dpo", "--config", _write(tmp_path / "dpo.yaml", dpo_a)]) == 0

    # The same as one pipeline file; the DPO data is missing at first, so the chain stops after SFT ...
    os.rename(pairs, pairs + ".away")
    pipe = _write(tmp_path / "pipe.yaml", {"run_dir": str(tmp_path / "b"), "model": "tiny-student", "stages": [
        dict({k: v for k, v in SFT.items() if k != "model"}, recipe="sft"), dict(dpo, recipe="dpo")]})
    assert cli.main(["run", pipe]) == 2
    assert os.path.isfile(tmp_path / "b/sft/stage.json") and not os.path.exists(tmp_path / "b/dpo")
    sft_record = json.loads((tmp_path / "b/sft/stage.json").read_text())
    # ... and a re-run skips the finished stage and trains the next one from its export.
    os.rename(pairs + ".away", pairs)
    assert cli.main(["run", pipe]) == 0
    assert json.loads((tmp_path / "b/sft/stage.json").read_text()) == sft_record  # not trained again
    _same(_weights(tmp_path / "a/sft"), _weights(tmp_path / "b/sft"))
    _same(_weights(tmp_path / "a/dpo"), _weights(tmp_path / "b/dpo"))
    assert json.loads((tmp_path / "b/dpo/stage.json").read_text())["inputs"] == {"sft": sft_record["id"]}

    # The Python object, one recipe, rows in memory: the same weights as `posttrain sft`.
    rows = [json.loads(line) for line in open("tests/data/sft_prompt_completion.jsonl")]
    out = Pipeline(recipe="sft", model="tiny-student", run_dir=str(tmp_path / "c"), progress=False,
                   **{k: v for k, v in SFT.items() if k != "model"}).run(rows)
    assert out["stages"][0]["hf"] == str(tmp_path / "c/sft/hf")
    _same(_weights(tmp_path / "a/sft"), _weights(tmp_path / "c/sft"))

    # An upstream stage trained again (another id): the downstream stage is not silently reused.
    rec = json.loads((tmp_path / "b/sft/stage.json").read_text())
    (tmp_path / "b/sft/stage.json").write_text(json.dumps(dict(rec, id="another")))
    with pytest.raises(Exception, match=r"stage 'dpo'.*trained after other runs of the stages \['sft'\]"):
        Pipeline.from_yaml(pipe, progress=False).run()


BAD = [  # (pipeline file text, what the message must say)
    ("run_dir: x\nstage: []\n", r"pipe.yaml: unknown key 'stage'.*did you mean 'stages'"),
    ("stages:\n  - recipe: sfft\n", r"pipe.yaml:2: stages\[0\].recipe must be one of .*did you mean 'sft'"),
    ("model: tiny-student\nstages:\n  - recipe: sft\n    data: {train: a.jsonl}\n  - recipe: grpo\n"
     "    data: {train: a.jsonl}\n    grpo: {num_generation: 4}\n",
     r"pipe.yaml:5 \(stage 'grpo'\): unknown key 'grpo.num_generation'.*did you mean 'num_generations'"),
    ("model: tiny-student\nstages:\n  - recipe: sft\n    data: {train: a.jsonl}\n  - recipe: sft\n"
     "    data: {train: a.jsonl}\n", r"pipe.yaml:5: two stages are named 'sft'"),
    ("model: tiny-student\nstages:\n  - recipe: sft\n    data: {train: a.jsonl}\n  - recipe: ppo\n"
     "    data: {train: a.jsonl}\n    ppo: {reward_model: '@rm'}\n",
     r"pipe.yaml:5 \(stage 'ppo'\): 'ppo.reward_model' is '@rm', but no earlier stage is named 'rm'"),
    ("model: tiny-student\nstages:\n  - recipe: sft\n    data: {train: a.jsonl}\n  - recipe: distill\n"
     "    data: {train: a.jsonl}\n", r"pipe.yaml:5 \(stage 'distill'\): no model: give the student"),
    ("stages:\n  - recipe: sft\n    data: {train: a.jsonl}\n", r"pipe.yaml:2 \(stage 'sft'\): no model: give "
     "the pipeline's 'model'"),
    ("model: tiny-studnt\nstages:\n  - recipe: sft\n", r"'model' is 'tiny-studnt'.*did you mean 'tiny-student'"),
    ("stages:\n  - recipe: sft\n   data: 1\n", r"pipe.yaml:3:\d+: YAML syntax error"),
    ("model: tiny-student\nstages:\n  - recipe: sft\n    config: missing.yaml\n", r"cannot read its config file"),
]


@pytest.mark.parametrize("text,message", BAD, ids=range(len(BAD)))
def test_bad_pipeline_files_exit_2_naming_the_place(tmp_path, capsys, monkeypatch, text, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pipe.yaml").write_text(text)
    assert cli.main(["run", "pipe.yaml", "run_dir=out"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    import re

    assert re.search(message, err), err
    assert not os.path.exists(tmp_path / "out")  # nothing written


def test_overrides_reach_the_named_stage(tmp_path):
    pipe = _write(tmp_path / "pipe.yaml", {"model": "tiny-student", "stages": [
        {"recipe": "sft", "data": {"train": "a.jsonl"}},
        {"recipe": "dpo", "name": "pref", "data": {"train": "b.jsonl"}}]})
    p = Pipeline.from_yaml(pipe, ["run_dir=elsewhere", "pref.optim.lr=0.25", "sft.train.steps=7"])
    assert [s.run_dir for s in p.stages] == ["elsewhere/sft", "elsewhere/pref"]
    assert p.stages[1].config.optim.lr == 0.25 and p.stages[0].config.train.steps == 7
    assert p.stages[1].config.model.path == "elsewhere/sft/hf"  # each stage's output is the next one's input
    with pytest.raises(Exception, match="unknown key 'dpo'.*known keys at the top level: run_dir, model, "
                                        "sharding, defaults, sft, pref"):
        Pipeline.from_yaml(pipe, ["dpo.optim.lr=1"])


def test_one_recipe_without_a_dataset_says_where_it_goes(tmp_path):
    p = Pipeline(recipe="sft", model="tiny-student", run_dir=str(tmp_path), train={"steps": 1})
    with pytest.raises(Exception, match=r"no dataset; give it as run\(dataset\)"):
        p.run()
    assert not os.listdir(tmp_path)  # nothing written


def test_task_is_the_old_name_of_recipe(tmp_path):
    """A stage's `task:` (and `Pipeline(task=...)`) still names its recipe, with a FutureWarning, for one release."""
    with pytest.warns(FutureWarning, match="'task' is now called 'recipe'"):
        p = Pipeline(model="tiny-student", run_dir=str(tmp_path),
                     stages=[{"task": "sft", "data": {"train": "a.jsonl"}}])
    assert p.stages[0].recipe == "sft" and p.stages[0].name == "sft"
    with pytest.warns(FutureWarning, match="'task' is now called 'recipe'"):
        assert Pipeline(task="dpo", model="tiny-student", run_dir=str(tmp_path)).stages[0].recipe == "dpo"
    with pytest.raises(PosttrainError, match="sets 'task', the old name of 'recipe', and 'recipe'"):
        Pipeline(model="tiny-student", run_dir=str(tmp_path), stages=[{"task": "sft", "recipe": "sft"}])

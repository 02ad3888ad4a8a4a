"""`posttrain sft` / `posttrain export` in-process: bad input exits 2 with a one-line message that
names the key or FILE:LINE and writes no run folder; good input trains and exports.

Every test sets run_dir under tmp_path; successful runs use train.steps=2 train.log_every=1 so
each costs one compile of the tiny model's train step.
"""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from posttrain.cli import main

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO / "configs" / "sft_tiny.yaml"
PROMPT_COMPLETION = REPO / "tests" / "data" / "sft_prompt_completion.jsonl"
FAST = ["train.steps=2", "train.log_every=1"]
RUN_FILES = ("config.yaml", "metrics.jsonl", "trainable.safetensors")

# Byte tokenizer: bos + 2 prompt bytes, 40 completion bytes + eos = 44 tokens > max_length=16.
LONG_ROW = {"prompt": "Q:", "completion": "x" * 40}
SHORT_ROW = {"prompt": "Q:", "completion": "A"}


def write_jsonl(path: Path, rows) -> Path:
    """Rows are dicts (dumped as JSON) or raw strings (written verbatim, for malformed lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def write_config(tmp_path: Path, train_file, name: str = "cfg.yaml", **sections) -> Path:
    """A tiny SFT config (demo-tiny preset, byte tokenizer) with absolute data path; `sections`
    are merged over it, e.g. data={"truncation": "drop"}."""
    cfg = {
        "model": {"preset": "demo-tiny"},
        "data": {"train": str(train_file), "max_length": 16, "truncation": "error"},
        "optim": {"lr": 1.0e-3},
        "train": {"steps": 2, "batch_size": 2, "log_every": 1},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def sft(config, run_dir, *overrides) -> int:
    return main(["sft", "--config", str(config), f"run_dir={run_dir}", *overrides])


def assert_user_error(rc, capsys, run_dir: Path, *needles) -> str:
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert err.startswith("posttrain: error:"), err
    assert err.count("\n") == 1, f"expected a one-line message, got:\n{err}"
    assert "Traceback" not in err and "Traceback" not in out
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    assert not run_dir.exists(), f"a failed run left {sorted(os.listdir(run_dir))} in {run_dir}"
    return err


def assert_finished_run(run_dir: Path, steps: int = 2) -> list[dict]:
    for name in RUN_FILES:
        assert (run_dir / name).is_file(), f"{name} missing from {sorted(os.listdir(run_dir))}"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(np.isfinite(m["loss"]) for m in metrics)
    return metrics


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("sections, overrides, needles", [
    pytest.param({"optim": {"lrr": 1e-3}}, [], ["{cfg}", "unknown key 'optim.lrr'", "did you mean 'lr'?"],
                 id="unknown-key-in-yaml"),
    pytest.param({"tarin": {"steps": 3}}, [], ["{cfg}", "unknown key 'tarin'", "did you mean 'train'?"],
                 id="unknown-section-in-yaml"),
    pytest.param({}, ["train.stepz=3"], ["command line", "unknown key 'train.stepz'", "did you mean 'steps'?"],
                 id="unknown-key-override"),
    pytest.param({}, ["train.steps=ten"], ["command line", "'train.steps' must be int", "'ten'"],
                 id="wrong-type-override"),
    pytest.param({"train": {"steps": "ten"}}, [], ["{cfg}", "'train.steps' must be int", "'ten'"],
                 id="wrong-type-in-yaml"),
    pytest.param({}, ["data.truncation=cut"], ["command line", "'data.truncation' must be one of",
                                               "'keep_start'", "'cut'"], id="bad-literal-override"),
])
def test_config_errors_exit_2(tmp_path, capsys, sections, overrides, needles):
    cfg = write_config(tmp_path, PROMPT_COMPLETION, **sections)
    run_dir = tmp_path / "run"
    rc = sft(cfg, run_dir, *overrides)
    assert_user_error(rc, capsys, run_dir, *[n.format(cfg=cfg) for n in needles])


def test_missing_config_file_exits_2(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = sft(tmp_path / "nope.yaml", run_dir)
    assert_user_error(rc, capsys, run_dir, "cannot read config file", str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_out_of_range_data_seed_leaves_no_run_folder(tmp_path, capsys, seed):
    cfg = write_config(tmp_path, PROMPT_COMPLETION)
    run_dir = tmp_path / "run"
    assert_user_error(sft(cfg, run_dir, f"data.seed={seed}"), capsys, run_dir, "seed", seed)


def test_unknown_model_dtype_exits_2(tmp_path, capsys):
    cfg = write_config(tmp_path, PROMPT_COMPLETION)
    run_dir = tmp_path / "run"
    assert_user_error(sft(cfg, run_dir, "model.dtype=float33"), capsys, run_dir, "model.dtype", "float33")


# ----------------------------------------------------------------------------- data errors


def test_missing_dataset_file_exits_2(tmp_path, capsys):
    missing = tmp_path / "no_such_data.jsonl"
    cfg = write_config(tmp_path, missing)
    run_dir = tmp_path / "run"
    assert_user_error(sft(cfg, run_dir), capsys, run_dir, str(missing), "does not exist")


def test_missing_dataset_file_via_override_exits_2(tmp_path, capsys):
    missing = tmp_path / "other.jsonl"
    cfg = write_config(tmp_path, PROMPT_COMPLETION)
    run_dir = tmp_path / "run"
    assert_user_error(sft(cfg, run_dir, f"data.train={missing}"), capsys, run_dir, str(missing), "does not exist")


def test_malformed_jsonl_line_names_file_and_line(tmp_path, capsys):
    data = write_jsonl(tmp_path / "rows.jsonl", [SHORT_ROW, SHORT_ROW, '{"prompt": "Q:", "completion": ', SHORT_ROW])
    cfg = write_config(tmp_path, data)
    run_dir = tmp_path / "run"
    assert_user_error(sft(cfg, run_dir), capsys, run_dir, f"{data}:3:", "not valid JSON")


def test_missing_column_names_line_and_accepted_fields(tmp_path, capsys):
    data = write_jsonl(tmp_path / "rows.jsonl", [SHORT_ROW, {"question": "Q:", "answer": "A"}])
    cfg = write_config(tmp_path, data)
    run_dir = tmp_path / "run"
    err = assert_user_error(sft(cfg, run_dir), capsys, run_dir, f"{data}:2:", "no recognised field",
                            "'answer'", "'question'")
    for field in ('"text"', '"prompt"', '"completion"', '"messages"'):
        assert field in err  # the accepted formats are listed


def test_empty_completion_names_line_and_field(tmp_path, capsys):
    data = write_jsonl(tmp_path / "rows.jsonl", [SHORT_ROW, SHORT_ROW, SHORT_ROW, {"prompt": "Q:", "completion": ""}])
    cfg = write_config(tmp_path, data)
    run_dir = tmp_path / "run"
    assert_user_error(sft(cfg, run_dir), capsys, run_dir, f"{data}:4:", "field 'completion' is empty")


def test_too_long_row_with_truncation_error(tmp_path, capsys):
    data = write_jsonl(tmp_path / "rows.jsonl", [SHORT_ROW, LONG_ROW, SHORT_ROW])
    cfg = write_config(tmp_path, data, data={"truncation": "error", "max_length": 16})
    run_dir = tmp_path / "run"
    assert_user_error(sft(cfg, run_dir), capsys, run_dir, f"{data}:2:", "44 tokens", "max_length=16",
                      "keep_start", "keep_end", "drop")


def test_truncation_error_is_the_default(tmp_path, capsys):
    data = write_jsonl(tmp_path / "rows.jsonl", [SHORT_ROW, LONG_ROW])
    cfg = tmp_path / "minimal.yaml"
    cfg.write_text(f"model: {{preset: demo-tiny}}\ndata: {{train: '{data}', max_length: 16}}\n")
    run_dir = tmp_path / "run"
    assert_user_error(sft(cfg, run_dir), capsys, run_dir, f"{data}:2:", "max_length=16")


def test_drop_with_every_row_too_long_exits_2(tmp_path, capsys):
    data = write_jsonl(tmp_path / "rows.jsonl", [LONG_ROW, LONG_ROW, LONG_ROW])
    cfg = write_config(tmp_path, data)
    run_dir = tmp_path / "run"
    assert_user_error(sft(cfg, run_dir, "data.truncation=drop"), capsys, run_dir, str(data),
                      "no usable examples", "dropped=3")


# ----------------------------------------------------------------------------- successful runs


@pytest.mark.parametrize("policy", ["keep_start", "keep_end"])
def test_too_long_rows_with_keep_policies_train(tmp_path, capsys, policy):
    data = write_jsonl(tmp_path / "rows.jsonl", [SHORT_ROW, LONG_ROW, LONG_ROW, SHORT_ROW])
    cfg = write_config(tmp_path, data)
    run_dir = tmp_path / "run"
    rc = sft(cfg, run_dir, f"data.truncation={policy}", *FAST)
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Traceback" not in err
    assert "[sft] done" in out and "'truncated': 2" in out
    assert_finished_run(run_dir)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["data"]["truncation"] == policy and saved["train"]["steps"] == 2


def test_skip_bad_rows_warns_and_trains(tmp_path, capsys):
    data = write_jsonl(tmp_path / "rows.jsonl", [SHORT_ROW, SHORT_ROW, "{not json", SHORT_ROW, {"foo": 1}])
    cfg = write_config(tmp_path, data)
    run_dir = tmp_path / "run"
    with pytest.warns(UserWarning, match="skipped 2 of 5 rows") as record:
        rc = sft(cfg, run_dir, "data.skip_bad_rows=true", *FAST)
    out, err = capsys.readouterr()
    assert rc == 0, err
    skipped = [str(w.message) for w in record if "skipped" in str(w.message)]
    assert len(skipped) == 1 and f"{data}:3" in skipped[0]  # one warning, naming the first bad row
    assert "'skipped': 2" in out
    assert_finished_run(run_dir)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The shipped configs/sft_tiny.yaml (data path made absolute), trained for 2 steps."""
    root = tmp_path_factory.mktemp("sft_tiny")
    run_dir = root / "run"
    rc = sft(TINY_CONFIG, run_dir, f"data.train={PROMPT_COMPLETION}", *FAST)
    assert rc == 0
    return run_dir


def test_tiny_run_writes_run_folder(tiny_run):
    metrics = assert_finished_run(tiny_run)
    assert metrics[-1]["step"] == 2
    saved = yaml.safe_load((tiny_run / "config.yaml").read_text())
    assert saved["model"]["preset"] == "demo-tiny" and saved["run_dir"] == str(tiny_run)


def test_rerun_of_finished_run_is_a_no_op(tiny_run, capsys):
    before = sorted(os.listdir(tiny_run))
    mtime = (tiny_run / "trainable.safetensors").stat().st_mtime_ns
    rc = sft(TINY_CONFIG, tiny_run, f"data.train={PROMPT_COMPLETION}", *FAST)
    out, err = capsys.readouterr()
    assert rc == 0 and "already finished" in out and "Traceback" not in err
    assert sorted(os.listdir(tiny_run)) == before
    assert (tiny_run / "trainable.safetensors").stat().st_mtime_ns == mtime


def test_rerun_with_a_different_config_exits_2(tiny_run, capsys):
    rc = sft(TINY_CONFIG, tiny_run, f"data.train={PROMPT_COMPLETION}", *FAST, "optim.lr=0.5")
    _, err = capsys.readouterr()
    assert rc == 2 and "different config" in err and "checkpoint.resume=false" in err


def test_export_of_tiny_run_loads(tiny_run, tmp_path, capsys):
    from flax import nnx

    from posttrain.models import from_pretrained
    from posttrain.runs import load_run

    out = tmp_path / "hf"
    rc = main(["export", "--run", str(tiny_run), "--out", str(out)])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert f"exported to {out}" in stdout
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    model = from_pretrained(str(out))
    assert model.cfg.vocab_size == 263 and model.cfg.num_layers == 3
    # The exported weights are the trained ones.
    _, _, trained = load_run(str(tiny_run))
    got = jax.tree.leaves(nnx.state(model, nnx.Param))
    want = jax.tree.leaves(nnx.state(trained, nnx.Param))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_export_of_missing_run_exits_2(tmp_path, capsys):
    out = tmp_path / "hf"
    rc = main(["export", "--run", str(tmp_path / "nope"), "--out", str(out)])
    _, err = capsys.readouterr()
    assert rc == 2 and err.startswith("posttrain: error:") and "Traceback" not in err
    assert "config.yaml" in err and "missing" in err
    assert not out.exists()


def test_plan_sizes_the_model_the_trainer_builds_and_resolves_minus_one(tmp_path, capsys):
    """`posttrain plan` on a preset counts the vocabulary of the tokenizer the trainer uses (byte
    tokenizer: 263 rows, not the preset's 2048), and accepts an axis of -1 as `sft` does."""
    from flax import nnx

    from posttrain.models import Transformer, count_params, preset
    from posttrain.plan import _gib

    cfg = write_config(tmp_path, PROMPT_COMPLETION, model={"preset": "tiny-llama"})
    assert main(["plan", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    n = count_params(nnx.eval_shape(lambda: Transformer(preset("tiny-llama", vocab_size=263), rngs=nnx.Rngs(0))))
    params_line = next(line.split() for line in out.splitlines() if line.split()[:1] == ["parameters"])
    assert params_line[1:] == _gib(4 * n).split()  # float32 parameters, one device
    assert main(["plan", "--config", str(cfg), "--devices", "4", "sharding.preset=fsdp",
                 "sharding.mesh_shape={fsdp: -1}"]) == 0
    assert "mesh fsdp 4 (4 devices)" in capsys.readouterr().out

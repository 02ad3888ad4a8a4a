"""No user data lost (issue #34): checkpoints on restore, export folders, and metrics.jsonl on resume.

- Checkpoints: a restore that does not fit the model being built (shapes, dtypes, another model) stops
  with a PosttrainError naming the step and leaves every checkpoint; a corrupt newest step is moved aside
  (renamed, nothing deleted) and the step before restores; any other restore failure (out of memory, a
  permission error) stops without touching a file.
- `posttrain export`: never into the run folder (the run still exports afterwards), never over a folder
  holding the user's files unless --overwrite, and a full disk mid-export leaves the previous export intact
  with no temporary folder behind; --dtype takes the usual aliases.
- Resume: a cut last line of metrics.jsonl (what a full disk leaves) is dropped with a warning, and the
  resumed run ends with the same weights, bit for bit, as an uninterrupted one.

The bad-input cases of the same issue (encodings, run_dir, Prometheus port, duplicate YAML keys, index.json
paths, dtype names) are in the catalogue, tests/reliability/bad_inputs.py. One tiny SFT run (demo-tiny, 4
steps) is trained per module and shared; the resume test trains twice more.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from posttrain.cli import main
from posttrain.errors import PosttrainError
from posttrain.train.checkpoint import Checkpointer

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "sft_prompt_completion.jsonl"


def tree(folder) -> dict[str, str]:
    """relative path -> sha1 of every file under `folder`."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = hashlib.sha1(fh.read()).hexdigest()
    return out


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("posttrain: error: ") and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------- checkpoints


STATE = {"w": jnp.arange(12.0).reshape(3, 4), "opt": {"mu": jnp.zeros(5)}, "key": jax.random.key(0)}


@pytest.fixture
def three_steps(tmp_path):
    """A checkpoint folder with steps 1, 2, 3 (w = step); its path."""
    ck = Checkpointer(str(tmp_path / "ck"), keep=5, async_save=False)
    for step in (1, 2, 3):
        ck.save(step, {**STATE, "w": STATE["w"] + step}, {"pos": step})
    ck.close()
    return tmp_path / "ck"


@pytest.mark.parametrize("like", [
    {**STATE, "w": jnp.zeros((3, 5))},  # another shape
    {**STATE, "w": jnp.zeros((3, 4), jnp.bfloat16)},  # another dtype
    {"w": STATE["w"], "key": STATE["key"]},  # another model: an array fewer
], ids=["shape", "dtype", "structure"])
def test_restore_that_does_not_fit_stops_naming_the_step_and_keeps_every_checkpoint(three_steps, like):
    before = tree(three_steps)
    ck = Checkpointer(str(three_steps), keep=5, async_save=False)
    with pytest.raises(PosttrainError, match=rf"checkpoint step 3 \({three_steps}/3\) does not fit the model being "
                                             r"built: .*Every checkpoint is kept"):
        ck.restore_latest(like)
    assert ck.steps() == [1, 2, 3]
    ck.close()
    assert tree(three_steps) == before  # nothing deleted, moved or rewritten


def test_corrupt_latest_falls_back_and_deletes_nothing(three_steps):
    state_files = [os.path.join(r, f) for r, _, fs in os.walk(three_steps / "3" / "state") for f in fs]
    for path in state_files:  # a torn copy: every file of step 3's train state cut to a third
        os.truncate(path, os.path.getsize(path) // 3)
    before = tree(three_steps)
    ck = Checkpointer(str(three_steps), keep=5, async_save=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, state, data, _ = ck.restore_latest(STATE)
    assert step == 2 and data == {"pos": 2}
    np.testing.assert_array_equal(state["w"], STATE["w"] + 2)
    said = [str(w.message) for w in caught if "is unreadable" in str(w.message)]
    assert len(said) == 1 and f"checkpoint step 3 in {three_steps}" in said[0] and "3.corrupt-1" in said[0], said
    # every file is still there, byte for byte: step 3's folder was renamed, not deleted
    after = tree(three_steps)
    assert after == {k.replace("3/", "3.corrupt-1/", 1) if k.startswith("3/") else k: v for k, v in before.items()}
    assert ck.steps() == [1, 2]
    ck.save(3, STATE, {"pos": 3})  # training writes step 3 again: the name is free
    ck.close()
    assert Checkpointer(str(three_steps), keep=5, async_save=False).restore_latest(STATE)[0] == 3


@pytest.mark.parametrize("failure", [
    ValueError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 12.00GiB"),
    PermissionError(errno.EACCES, "Permission denied"),
], ids=["out-of-memory", "permission"])
def test_restore_failure_other_than_corruption_stops_and_keeps_everything(three_steps, failure):
    before = tree(three_steps)
    ck = Checkpointer(str(three_steps), keep=5, async_save=False)

    def restore(step, **_):
        raise failure

    ck.manager.restore = restore
    with pytest.raises(PosttrainError, match=rf"could not restore checkpoint step 3 from {three_steps}/3 "
                                             rf"\({type(failure).__name__}: .*no checkpoint was changed or removed"):
        ck.restore_latest(STATE)
    assert ck.steps() == [1, 2, 3] and tree(three_steps) == before


# ----------------------------------------------------------------------------- one tiny run, shared

STEPS = 4


def write_config(folder: Path) -> Path:
    cfg = {"model": {"preset": "demo-tiny"},
           "data": {"train": str(DATA), "max_length": 16, "truncation": "keep_start"},
           "optim": {"lr": 1.0e-3},
           "train": {"steps": STEPS, "batch_size": 2, "log_every": 1},
           "checkpoint": {"every": 2, "keep": 3},
           "metrics": {"sinks": ["jsonl"], "peak_flops": 1.0e11}}  # a fixed peak: no matmul timing
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def sft(config: Path, run_dir: Path) -> int:
    return main(["sft", "--config", str(config), f"run_dir={run_dir}"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(config, run folder) of an uninterrupted 4-step run."""
    root = tmp_path_factory.mktemp("tiny")
    config = write_config(root)
    assert sft(config, root / "run") == 0
    return config, root / "run"


def siblings(folder: Path) -> list[str]:
    """Temporary folders an export left beside `folder`."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(folder.name + "."))


# ----------------------------------------------------------------------------- export


def test_export_into_the_run_folder_is_refused_and_the_run_still_exports(tiny, tmp_path, capsys):
    from posttrain.models import from_pretrained

    _, run = tiny
    before = tree(run)
    for out in (run, run.parent):  # the run folder itself, and a folder holding it
        assert main(["export", "--run", str(run), "--out", str(out)]) == 2
        line = one_error(capsys)
        assert f"--out {out}" in line and "exporting there would replace the run" in line, line
        assert tree(run) == before  # trainable.safetensors and everything else untouched
    out = tmp_path / "hf"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    assert from_pretrained(str(out)).cfg.num_layers == 3
    exported = load_file(str(out / "model.safetensors"))
    # exporting again replaces a previous export (nothing of the user's in it), with nothing left beside it
    assert main(["export", "--run", str(run), "--out", str(out), "--dtype", "fp16"]) == 0
    again = load_file(str(out / "model.safetensors"))
    assert again.keys() == exported.keys() and all(a.dtype == np.float16 for a in again.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert siblings(out) == [] and tree(run) == before


def test_export_over_a_folder_with_user_files_needs_overwrite(tiny, tmp_path, capsys):
    _, run = tiny
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert main(["export", "--run", str(run), "--out", str(out)]) == 2
    line = one_error(capsys)
    assert "already holds files that posttrain export did not write ('notes.txt')" in line and "--overwrite" in line
    assert tree(out) == {"notes.txt": hashlib.sha1(b"mine\n").hexdigest()}
    # a previous export with a file of the user's added is the user's folder too
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == 0
    (tmp_path / "hf" / "README.md").write_text("my model card\n")
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == 2
    assert "('README.md')" in one_error(capsys) and (tmp_path / "hf" / "README.md").is_file()
    # --overwrite replaces the folder as a whole (atomically: nothing left beside it)
    assert main(["export", "--run", str(run), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file() and siblings(out) == []
    # --overwrite never replaces a run folder
    assert main(["export", "--run", str(run), "--out", str(run), "--overwrite"]) == 2
    assert "is the run folder" in one_error(capsys) and (run / "trainable.safetensors").is_file()


def test_full_disk_during_export_keeps_the_previous_export(tiny, tmp_path, capsys, monkeypatch):
    import posttrain.models.hf as hf

    _, run = tiny
    out = tmp_path / "hf"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    capsys.readouterr()
    before = tree(out)

    def full_disk(tensors, filename, metadata=None):  # half a file written, then the disk is full
        with open(filename, "wb") as fh:
            fh.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(hf, "save_file", full_disk)
    assert main(["export", "--run", str(run), "--out", str(out), "--dtype", "bf16"]) == 2
    line = one_error(capsys)
    assert f"could not write the export to {out}: No space left on device" in line and "is unchanged" in line, line
    assert tree(out) == before and siblings(out) == []


def test_dtype_aliases():
    from posttrain.models.hf import canonical_dtype

    for names, want in ((("fp16", "float16", "half", "FP16"), "float16"), (("bf16", "bfloat16"), "bfloat16"),
                        (("fp32", "float32", "float"), "float32")):
        assert [canonical_dtype(n) for n in names] == [want] * len(names)
    for bad in ("bfloat", "fp8", "int8", ""):
        with pytest.raises(PosttrainError, match=r"use one of float32 \(fp32, float, f32\); bfloat16 \(bf16\); "
                                                 r"float16 \(fp16, half, f16\)"):
            canonical_dtype(bad, "--dtype")


# ----------------------------------------------------------------------------- resume after a cut metrics line


def test_resume_drops_a_cut_last_metrics_line_and_ends_bitwise_equal(tiny, tmp_path, monkeypatch, capsys):
    import posttrain.train.trainer as engine
    from posttrain.train.loop import Hook

    config, ref = tiny
    run = tmp_path / "run"
    real_loop = engine.train_loop

    def sigterm_at_3(step, state, metrics):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # noted by the run's handler: checkpoint, then stop

    monkeypatch.setattr(engine, "train_loop",
                        lambda *a, hooks=(), **kw: real_loop(*a, hooks=[*hooks, Hook(sigterm_at_3, 1)], **kw))
    assert sft(config, run) == 128 + signal.SIGTERM
    monkeypatch.setattr(engine, "train_loop", real_loop)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    assert [json.loads(ln)["step"] for ln in lines] == [1, 2, 3]
    metrics.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # a full disk cut it in half
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sft(config, run) == 0, capsys.readouterr().err
    said = [str(w.message) for w in caught if "cut off" in str(w.message)]
    assert len(said) == 1 and f"{metrics}:3: the last line is cut off" in said[0], said
    a, b = load_file(str(ref / "trainable.safetensors")), load_file(str(run / "trainable.safetensors"))
    assert a.keys() == b.keys()
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)  # bitwise
    # step 3's record was the one the disk cut; every other step is logged once, as in the reference
    logged = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 4]
    reference = {r["step"]: r["loss"] for r in map(json.loads, (ref / "metrics.jsonl").read_text().splitlines())}
    assert all(r["loss"] == reference[r["step"]] for r in logged)


def test_truncate_jsonl_keeps_a_whole_last_record_and_refuses_a_bad_middle_line(tmp_path):
    from posttrain.train.trainer import _truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}')  # the last record lacks only its newline
    _truncate_jsonl(str(path), 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\n{"ste\n{"step": 2}\n')
    with pytest.raises(PosttrainError, match=rf"{path}:2: not a JSON record"):
        _truncate_jsonl(str(path), 2)
    assert path.read_text() == '{"step": 1}\n{"ste\n{"step": 2}\n'  # left as it was, for the user to look at

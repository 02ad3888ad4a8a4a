"""Checkpoints: exact resume after SIGKILL, SIGTERM and Ctrl-C, corrupt-latest fallback, crash during save, NaN
guard, one process per run folder."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

from posttrain import config as C
from posttrain.errors import PosttrainError
from posttrain.trainers.sft import SFTTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "sft_prompt_completion.jsonl")
ARGS = ["model.preset=demo-tiny", f"data.train={DATA}", "data.max_length=32", "train.steps=12",
        "train.batch_size=4", "train.log_every=1", "checkpoint.every=3", "checkpoint.keep=2",
        "metrics.sinks=[jsonl]", "optim.lr=1e-3"]


def _run(kill_at, run_dir, *extra, signal="SIGKILL"):
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]  # one device
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), PYTHONPATH=os.path.dirname(HERE), KILL_SIGNAL=signal)
    cfg = os.path.join(os.path.dirname(run_dir), "empty.yaml")  # everything comes from the overrides
    open(cfg, "w").close()
    cmd = [sys.executable, os.path.join(HERE, "kill_worker.py"), str(kill_at), "--config", cfg,
           f"run_dir={run_dir}", *ARGS, *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(ln) for ln in fh if ln.strip()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("full") / "run")
    r = _run(0, run_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    return run_dir


@pytest.mark.slow
def test_sigkill_at_several_steps_then_resume_is_bitwise_exact(uninterrupted, tmp_path):
    run_dir = str(tmp_path / "run")
    # 9 is a checkpoint step: killed while its async save is in flight, so the resumed run must
    # fall back to step 6 and run 7..12 again
    r = _run(9, run_dir)
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])
    r = _run(0, run_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming" in r.stdout
    a = load_file(os.path.join(uninterrupted, "trainable.safetensors"))
    b = load_file(os.path.join(run_dir, "trainable.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    logged = [m["step"] for m in _steps(run_dir) if "loss" in m]
    assert logged == list(range(1, 13))  # every step exactly once
    full = {m["step"]: m["loss"] for m in _steps(uninterrupted) if "loss" in m}
    assert all(m["loss"] == full[m["step"]] for m in _steps(run_dir) if "loss" in m)


@pytest.mark.slow
def test_sigterm_and_ctrl_c_checkpoint_the_current_step_and_resume_bitwise(uninterrupted, tmp_path):
    """SIGTERM after step 4 and Ctrl-C (SIGINT) after step 8, neither a checkpoint step: each run saves
    that step, says so in one line and exits 128 + the signal; the reruns end bitwise equal to an
    uninterrupted run, every step logged once."""
    run_dir = str(tmp_path / "run")
    for at, sig, code in ((4, "SIGTERM", 143), (8, "SIGINT", 130)):
        r = _run(at, run_dir, signal=sig)
        assert r.returncode == code, (sig, r.returncode, r.stderr[-2000:])
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("posttrain:")]
        assert lines == [f"posttrain: [sft] {sig}: stopped after step {at} with its checkpoint in "
                         f"{run_dir}/checkpoints; run the same command again to resume"], r.stderr[-2000:]
        assert "Traceback" not in r.stderr
        assert max(int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit()) == at
    r = _run(0, run_dir)
    assert r.returncode == 0 and "from the checkpoint at step 8" in r.stdout, r.stderr[-2000:]
    a = load_file(os.path.join(uninterrupted, "trainable.safetensors"))
    b = load_file(os.path.join(run_dir, "trainable.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert [m["step"] for m in _steps(run_dir) if "loss" in m] == list(range(1, 13))


@pytest.mark.slow
def test_rerun_of_a_finished_run_changes_nothing(uninterrupted, capsys):
    before = load_file(os.path.join(uninterrupted, "trainable.safetensors"))
    result = SFTTrainer(_config(uninterrupted), progress=False).train()
    assert result.get("finished") and "already finished" in capsys.readouterr().out
    after = load_file(os.path.join(uninterrupted, "trainable.safetensors"))
    assert all(np.array_equal(before[k], after[k]) for k in before)


def _config(run_dir, **over):
    overrides = ARGS + [f"run_dir={run_dir}"] + [f"{k}={v}" for k, v in over.items()]
    return C.load(C.SFTConfig, None, overrides)


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path):
    run_dir = str(tmp_path / "run")
    SFTTrainer(_config(run_dir, **{"train.steps": 6, "checkpoint.async_save": "false"}), progress=False).train()
    ckdir = os.path.join(run_dir, "checkpoints")
    assert sorted(int(d) for d in os.listdir(ckdir) if d.isdigit()) == [3, 6]
    for root, _, files in os.walk(os.path.join(ckdir, "6", "state")):
        for f in files:
            with open(os.path.join(root, f), "r+b") as fh:
                fh.truncate(max(0, os.path.getsize(os.path.join(root, f)) // 3))
    trainer = SFTTrainer(_config(run_dir, **{"train.steps": 6}), progress=False)
    with pytest.warns(UserWarning, match="checkpoint step 6 .* unreadable"):
        result = trainer.train()
    assert result["step"] == 6 and not result.get("finished")  # steps 4..6 were run again from step 3
    assert [m["step"] for m in _steps(run_dir) if "loss" in m] == [1, 2, 3, 4, 5, 6]


def test_nonfinite_step_is_skipped_and_counted():
    from flax import nnx

    from posttrain.models import Transformer, preset
    from posttrain.train import init_state, make_train_step

    model = Transformer(preset("demo-tiny"), rngs=nnx.Rngs(0))

    def loss(policy, batch, *, frozen=None, rng=None):
        out = policy(batch["tokens"], batch["positions"]).logits
        total = jnp.sum(out[..., 0] * batch["weights"]) * batch["scale"][0]
        return total, {"denom": jnp.sum(batch["weights"]), "loss": total}

    opt = optax.adam(1e-2)
    graphdef, state = init_state(model, opt)
    step = make_train_step(loss, opt, graphdef)
    batch = {"tokens": jnp.ones((2, 4), jnp.int32), "positions": jnp.broadcast_to(jnp.arange(4), (2, 4)),
             "weights": jnp.ones((2, 4)), "scale": jnp.ones((2,))}
    before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    state, m = step(state, dict(batch, scale=jnp.full((2,), jnp.nan)))
    assert float(m["skipped"]) == 1.0 and int(state.nonfinite) == 1
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(state.params)))
    state, m = step(state, batch)
    assert float(m["skipped"]) == 0.0 and int(state.nonfinite) == 0
    assert not all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(state.params)))


def test_nan_run_halts_with_last_good_checkpoint_intact(tmp_path, monkeypatch):
    """From step 5 on every batch has NaN loss weights: 2 skipped steps in a row halt the run."""
    import posttrain.trainers.sft as sft_mod

    real_batches = sft_mod.batches
    monkeypatch.setattr(sft_mod, "batches", lambda *a, **kw: _StatefulNaN(real_batches(*a, **kw), from_index=4))
    run_dir = str(tmp_path / "run")
    trainer = SFTTrainer(_config(run_dir, **{"checkpoint.async_save": "false", "train.max_nonfinite": 2}),
                         progress=False)
    with pytest.raises(PosttrainError, match="NaN/Inf in 2 consecutive steps"):
        trainer.train()
    steps = sorted(int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit())
    assert steps == [3]  # the last good checkpoint, written before the NaNs
    assert not os.path.exists(os.path.join(run_dir, "trainable.safetensors"))


class _StatefulNaN:
    """A Grain dataset wrapper whose iterator turns every batch from `from_index` on into NaN weights."""

    def __init__(self, ds, from_index):
        self.ds, self.from_index = ds, from_index

    def __iter__(self):
        return _NaNIter(iter(self.ds), self.from_index)


class _NaNIter:
    def __init__(self, it, from_index):
        self.it, self.from_index, self.i = it, from_index, 0

    def __iter__(self):
        return self

    def __next__(self):
        b = next(self.it)
        self.i += 1
        if self.i > self.from_index:
            b = dict(b, weights=np.full_like(b["weights"], np.nan))
        return b

    def get_state(self):
        return self.it.get_state()

    def set_state(self, s):
        self.it.set_state(s)


def test_a_second_process_on_the_run_folder_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path, capsys):
    """While one process trains in a run folder another is refused (exit 2, naming the holder's pid,
    nothing written); SIGKILL of the holder frees the folder (the kernel drops its lock)."""
    from posttrain.cli import main
    from posttrain.train.lifecycle import RunLock

    run = tmp_path / "run"
    hold = ("import sys, time\nfrom posttrain.train.lifecycle import RunLock\nlock = RunLock(sys.argv[1])\n"
            "print('locked', flush=True)\ntime.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.path.dirname(HERE)))
    try:
        assert holder.stdout.readline().strip() == "locked"
        cfg = tmp_path / "empty.yaml"
        cfg.write_text("")
        assert main(["sft", "--config", str(cfg), f"run_dir={run}", *ARGS]) == 2
        err = capsys.readouterr().err
        assert f"another posttrain process (pid {holder.pid}) is training in this run folder" in err, err
        assert os.listdir(run) == [".lock"]  # no config.yaml, no checkpoint, no metrics
    finally:
        holder.kill()
        holder.wait()
    RunLock(str(run)).release()  # the killed holder left no lock behind

"""`posttrain sft --distributed` with two JAX processes on localhost trains like one device.

Two children (`python -m posttrain.cli sft --distributed`, one CPU device each, gloo collectives)
share one run_dir and a dp mesh; each feeds its half of every global batch. Process 0 alone
writes config, metrics and weights; both join the Orbax checkpoints. The weights, the logged
losses and the checkpointed data-iterator state must equal a single-process one-device run of
the same config (<= 1e-5). Children are always killed.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file
from test_multiprocess import _child_env, _free_port, kill_children, wait_children

from posttrain import config as C
from posttrain.trainers.sft import SFTTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIMEOUT_S = 300  # after the in-process reference; generous: CI runs two test workers on 2 cores
CONFIG = {
    "model": {"preset": "demo-tiny"},
    "data": {"train": os.path.join(HERE, "data", "sft_prompt_completion.jsonl"), "max_length": 32},
    # eps 1e-5: see tests/test_sharded_sft.py (sign-like Adam updates of near-zero gradients)
    "optim": {"eps": 1e-5},
    "train": {"steps": 4, "batch_size": 4, "log_every": 1},
    "checkpoint": {"every": 2},
    # a fixed peak: no FLOP/s measurement per process on the 2-core test machines
    "metrics": {"sinks": ["jsonl"], "peak_flops": 1e12},
}


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(ln) for ln in fh if ln.strip()]


def _iterator_states(run_dir):
    """step -> the data-iterator JSON of each Orbax checkpoint (its `data` item, written once)."""
    out = {}
    for path in glob.glob(os.path.join(run_dir, "checkpoints", "*", "data", "metadata")):
        with open(path) as fh:
            out[int(path.split(os.sep)[-3])] = json.load(fh)["iterator"]
    return out


def test_two_processes_sft_cli_equals_one_device(tmp_path):
    cfg_file = tmp_path / "sft.yaml"
    cfg_file.write_text(yaml.safe_dump(CONFIG))
    run_dir = str(tmp_path / "run")
    port = _free_port()
    procs, logs = [], []
    t0 = time.perf_counter()
    try:
        for pid in range(2):
            log = open(tmp_path / f"proc{pid}.log", "w")
            logs.append(log)
            cmd = [sys.executable, "-m", "posttrain.cli", "sft", "--distributed", "--config", str(cfg_file),
                   "sharding.preset=dp", f"run_dir={run_dir}"]
            procs.append(subprocess.Popen(cmd, env=_child_env(port, pid), cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT))
        # the single-process, one-device reference (no mesh), while the children run
        ref_dir = str(tmp_path / "ref")
        ref = SFTTrainer(C.load(C.SFTConfig, str(cfg_file), [f"run_dir={ref_dir}"]), progress=False)
        assert ref.mesh is None
        ref.train()
        wait_children(procs, tmp_path, time.monotonic() + TIMEOUT_S)
    finally:
        kill_children(procs, logs)
    seconds = time.perf_counter() - t0

    # the weights: written once (by process 0), equal to the one-device run
    assert not glob.glob(os.path.join(run_dir, "*.tmp"))
    w, ref_w = load_file(os.path.join(run_dir, "trainable.safetensors")), load_file(
        os.path.join(ref_dir, "trainable.safetensors"))
    assert w.keys() == ref_w.keys()
    diff = max(float(np.abs(w[k] - ref_w[k]).max()) for k in ref_w)
    assert diff <= 1e-5

    # metrics: each step logged exactly once, with the one-device losses
    recs, ref_recs = _records(run_dir), _records(ref_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    loss_diff = max(abs(r["loss"] - q["loss"]) for r, q in zip(recs, ref_recs))
    assert loss_diff <= 1e-5
    assert recs[-1]["loss"] < recs[0]["loss"]

    # checkpoints at steps 2 and 4 with the iterator position of the one-device run
    states = _iterator_states(run_dir)
    assert sorted(states) == [2, 4] and states == _iterator_states(ref_dir)

    # only process 0 prints
    out0, out1 = ((tmp_path / f"proc{pid}.log").read_text() for pid in range(2))
    assert "[sft] memory estimate" in out0 and "[sft] memory estimate" not in out1
    print(f"2 processes + reference: {seconds:.1f} s; max |param diff| {diff:.2e}, max |loss diff| {loss_diff:.2e}")

    # the run folder locked by another process: both processes refuse (exit 2), neither waits at a barrier
    from posttrain.recipes.lifecycle import RunLock

    lock = RunLock(run_dir)
    port = _free_port()
    procs, logs = [], []
    try:
        for pid in range(2):
            log = open(tmp_path / f"locked{pid}.log", "w")
            logs.append(log)
            cmd = [sys.executable, "-m", "posttrain.cli", "sft", "--distributed", "--config", str(cfg_file),
                   "sharding.preset=dp", f"run_dir={run_dir}"]  # the same run: the lock, not the config, refuses
            procs.append(subprocess.Popen(cmd, env=_child_env(port, pid), cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        kill_children(procs, logs)
        lock.release()
    out0, out1 = ((tmp_path / f"locked{pid}.log").read_text() for pid in range(2))
    assert codes == [2, 2], (codes, out0[-2000:], out1[-2000:])
    assert f"another posttrain process (pid {os.getpid()})" in out0 and "process 0 could not lock" in out1


def test_batch_size_not_divisible_by_processes_is_a_user_error(tmp_path):
    """Checked in the trainer before anything is written (one process here: 3 % 2 is faked)."""
    from unittest import mock

    from posttrain.errors import PosttrainError

    cfg = C.load(C.SFTConfig, None, ["model.preset=demo-tiny", f"data.train={CONFIG['data']['train']}",
                                     "train.batch_size=3", "sharding.preset=dp", f"run_dir={tmp_path / 'run'}"])
    with mock.patch("jax.process_count", return_value=2), pytest.raises(PosttrainError, match="train.batch_size=3"):
        SFTTrainer(cfg, progress=False)
    assert not os.path.exists(tmp_path / "run")

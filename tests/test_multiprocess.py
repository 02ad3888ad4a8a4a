"""Two JAX processes on localhost form one 2-device data-parallel mesh and train like one device.

Each child (tests/mp_worker.py) has one CPU device, joins through `init_distributed` (env vars),
feeds its own half of the global batch and runs 5 SFT steps; both must end with the losses and
parameters of a single-process run on the whole batch (<= 1e-5). Children are always killed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import mp_worker
import numpy as np
import pytest

from posttrain import sharding as sh
from posttrain.errors import PosttrainError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(port: int, pid: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "XLA_FLAGS"))}
    # one CPU device per process: the parent's 8-device XLA flag must not leak into the children
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid),
               PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return env



def wait_children(procs, log_dir, deadline):
    """Wait for every child until `deadline` (time.monotonic()); fail with the log tail of the first bad one."""
    for pid, p in enumerate(procs):
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            out = (log_dir / f"proc{pid}.log").read_text()[-3000:]
            pytest.fail(f"process {pid} {'timed out' if rc is None else f'exited with {rc}'}:\n{out}")


def kill_children(procs, logs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in logs:
        log.close()

def test_two_processes_train_like_one_device(tmp_path):
    port = _free_port()
    procs, logs = [], []
    try:
        for pid in range(2):
            log = open(tmp_path / f"proc{pid}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "mp_worker.py"),
                                           str(tmp_path / f"proc{pid}.npz")],
                                          env=_child_env(port, pid), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        ref_losses, ref_params = mp_worker.run(None)  # the single-device reference, while they run
        wait_children(procs, tmp_path, time.monotonic() + TIMEOUT_S)
    finally:
        kill_children(procs, logs)

    results = [np.load(tmp_path / f"proc{pid}.npz") for pid in range(2)]
    assert [int(r["process"]) for r in results] == [0, 1]
    ref_sum = float(sum(np.abs(v.astype(np.float64)).sum() for v in ref_params.values()))
    for r in results:
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=0, atol=1e-5)
        assert abs(float(r["checksum"]) - ref_sum) <= 1e-5 * max(1.0, ref_sum)
        for k, v in ref_params.items():
            np.testing.assert_allclose(r["param:" + k], v, rtol=0, atol=1e-5, err_msg=k)
    assert ref_losses[-1] < ref_losses[0]
    for pid in range(2):  # timings and losses, shown with pytest -s
        print((tmp_path / f"proc{pid}.log").read_text().strip().splitlines()[-1])
    print("max |loss diff|", max(float(np.max(np.abs(r["losses"] - ref_losses))) for r in results),
          "max |param diff|", max(float(np.max(np.abs(r["param:" + k] - v))) for r in results
                                  for k, v in ref_params.items()))


def test_init_distributed_is_a_noop_without_env_and_names_missing_vars(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_")):
            monkeypatch.delenv(k)
    assert sh.init_distributed() is False
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    with pytest.raises(PosttrainError, match="JAX_NUM_PROCESSES, JAX_PROCESS_ID missing"):
        sh.init_distributed()

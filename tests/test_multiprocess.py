"""Multi-process helpers (child environment, waiting, killing) and `init_distributed`'s checks.

Two processes training like one device is tested end to end through the CLI in
test_multiprocess_sft.py (losses, weights, checkpoints and printing against a one-device run).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

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
               JAX_COMPILATION_CACHE_DIR=os.environ.get("JAX_COMPILATION_CACHE_DIR", ""),
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

def test_init_distributed_is_a_noop_without_env_and_names_missing_vars(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_")):
            monkeypatch.delenv(k)
    assert sh.init_distributed() is False
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    with pytest.raises(PosttrainError, match="JAX_NUM_PROCESSES, JAX_PROCESS_ID missing"):
        sh.init_distributed()

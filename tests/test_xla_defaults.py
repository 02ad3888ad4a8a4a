"""posttrain's CPU XLA default (YNNPACK fusions off) applies whenever no JAX backend has started yet."""

import os
import subprocess
import sys

import pytest

FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def _flags_after(code: str, env_flags=None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if env_flags is not None:
        env["XLA_FLAGS"] = env_flags
    code += "\nimport os; print('FLAGS=' + os.environ.get('XLA_FLAGS', ''))"
    out = subprocess.run([sys.executable, "-c", code],
                         env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1].removeprefix("FLAGS=")


@pytest.mark.parametrize("code, expect_flag", [
    ("import jax\nimport posttrain", True),  # importing jax does not start a backend
    ("import jax\njax.devices()\nimport posttrain", False),  # too late: XLA already read its flags
])
def test_flag_set_only_before_a_backend_starts(code, expect_flag):
    assert (f"{FLAG}=" in _flags_after(code)) == expect_flag


def test_user_value_wins():
    assert _flags_after("import posttrain", env_flags=f"{FLAG}=dot") == f"{FLAG}=dot"


_FAULTS = """
import resource
import posttrain
import jax, jax.numpy as jnp
f = jax.jit(lambda x, v: jnp.exp(x) @ v)  # a 64 MB temporary per call
x, v = jnp.ones((4096, 4096)), jnp.ones((4096,))
faults = []
for _ in range(60):
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(f(x, v))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
print("FAULTS=" + ",".join(map(str, faults)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"),
                    reason="glibc's malloc only")
def test_cpu_temporaries_stay_mapped():
    """POSTTRAIN_KEEP_HEAP=1: a call's temporaries are served from the heap the previous calls freed; once the heap has
    grown (the first calls: 1-9 extra temporaries before reuse when measured, more on a loaded machine, where 20 calls
    once left 3 of the last 5 faulting), a call faults in no new pages. Unset: each call maps them afresh."""
    def faults(keep):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "POSTTRAIN_KEEP_HEAP": keep}
        out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, check=True)
        return [int(v) for v in out.stdout.strip().splitlines()[-1].removeprefix("FAULTS=").split(",")]

    kept = faults("1")
    assert sorted(kept[-10:])[5] < 1000, kept  # 64 MB are 16,384 pages
    assert min(faults("")) > 10_000  # the default: glibc's mmap for large blocks


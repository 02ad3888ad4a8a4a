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

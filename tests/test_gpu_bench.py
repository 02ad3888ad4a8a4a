"""benchmarks/gpu.sh --dry-run: the GPU benchmark's whole code path on CPU with a tiny model, so it cannot rot."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_bench_dry_run(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PY=sys.executable)
    # one CPU device, as on a 1-GPU machine (the 8B FSDP section then reports itself skipped)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu.sh"), "--dry-run", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["dry_run"] and res["n_devices"] == 1
    assert res["train_tok_s"] > 0 and res["train_mfu"] > 0
    assert res["rollout_tok_s"] > 0
    assert res["grpo_step_s"] > 0
    assert res["plan_total_bytes"] > 0 and res["grpo"]["plan_total_bytes"] > 0
    assert res["sft_fsdp"]["skipped"]
    rows = {line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| ")}
    for row in ("device", "SFT tokens/s", "SFT MFU", "SFT plan estimate", "GRPO rollout tokens/s", "GRPO step time"):
        assert row in rows, (row, sorted(rows))

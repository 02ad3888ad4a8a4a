"""benchmarks/vlm.py --dry-run: the vision-language CPU benchmark's whole code path (posttrain's SFT step and Sampler
against transformers + PyTorch on a tiny random Qwen3-VL, in one process) at a minimal size, so it cannot rot."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_vlm_bench_dry_run(tmp_path):
    out = tmp_path / "vlm.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "vlm.py"), "--dry-run", "--threads", "2",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["dry_run"] and not res["train_vision"]
    for side in ("posttrain", "hf"):
        assert res[f"{side}_train_tok_s"] > 0 and res[f"{side}_gen_tok_s"] > 0
        assert res[f"{side}_train_first_step_s"] > 0 and res[f"{side}_gen_first_call_s"] > 0
    assert res["posttrain_n_params"] == res["hf_n_params"]  # the same folder on both sides
    # the same work: the first SFT step's loss on the same image rows, and the same greedy tokens from the same images
    losses = res["first_step_loss"]
    assert abs(losses["posttrain"] - losses["hf"]) <= 1e-4 * abs(losses["hf"]), losses
    assert res["greedy_tokens_equal_fraction"] == 1.0
    assert res["train_ratio"] > 0 and res["gen_ratio"] > 0 and res["peak_rss_bytes"] > 0
    assert "SUMMARY train" in proc.stdout

#!/usr/bin/env python
"""Rollout variants in the demo's GRPO stage (issue #37): held-out accuracy, mismatch and speed against the default.

Needs a finished `make demo` (its SFT export and data in --demo). Runs the demo's GRPO stage (same steps, seed,
LoRA, reward; `demos/demo.grpo_stage`) four ways into --out: float32 on-policy sampling (the demo as it is), a
bfloat16 sampler without correction, a bfloat16 sampler with truncated importance sampling (rollout.is_mode
token_truncate, is_clip_max 3: TIS), and off-policy rollouts one step stale (rollout.max_staleness 1). Each
run is exported and scored greedily on the 200 held-out questions as
the demo scores its stages; the mean per-token |trainer - sampler| log-prob difference, the mismatch KL and the
mean rollout generation seconds per step come from the run's metrics. Then the bare sampler speed, float32 vs
bfloat16, on the SFT model (200 prompts x 8 samples, medians of --rounds interleaved rounds). JSON on stdout.

Usage: .venv/bin/python benchmarks/rollouts.py [--demo runs/demo] [--out runs/rollouts] [--rounds 5]
       [--variants stale1,stale1_split] [--no-speed]
(stale1_split needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4)
"""

import argparse
import json
import platform
import shutil
import statistics
import time

ap = argparse.ArgumentParser()
ap.add_argument("--demo", default="runs/demo")
ap.add_argument("--out", default="runs/rollouts")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--json", default=None)
ap.add_argument("--variants", default=None, help="comma-separated variant names (default: all that fit the devices)")
ap.add_argument("--no-speed", action="store_true", help="skip the bare sampler speed rounds")
args = ap.parse_args()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import posttrain  # noqa: E402,F401  (first: CPU XLA defaults before JAX starts)
from posttrain.demos import demo  # noqa: E402
from posttrain.generate import Sampler, SamplingParams  # noqa: E402
from posttrain.models import from_pretrained  # noqa: E402
from posttrain.report import collect_series, read_metrics  # noqa: E402
from posttrain.runs import export_run  # noqa: E402
from posttrain.tasks import addition  # noqa: E402
from posttrain.tokenizer import byte_tokenizer  # noqa: E402

_, held = addition.make_pairs(digits=2, seed=0, n_eval=200)
tok = byte_tokenizer()
greedy = demo.Greedy(tok, [r["prompt"] for r in held])
VARIANTS = {"float32": {}, "bfloat16": {"rollout": {"dtype": "bfloat16"}},
            "bfloat16_tis": {"rollout": {"dtype": "bfloat16", "is_mode": "token_truncate", "is_clip_max": 3.0}},
            "stale1": {"rollout": {"max_staleness": 1}},
            # the sampler on 2 devices of its own, the trainer data-parallel on 2 (needs 4 devices: on a CPU,
            # XLA_FLAGS=--xla_force_host_platform_device_count=4)
            "stale1_split": {"rollout": {"max_staleness": 1, "devices": 2},
                             "sharding": {"preset": "dp", "mesh_shape": {"data": 2}}}}
result = {"bench": "rollouts", "cpu": platform.processor() or platform.machine(), "jax": jax.__version__,
          "variants": {}}
chosen = args.variants.split(",") if args.variants else [n for n in VARIANTS if jax.device_count() >= 4 or
                                                           "sharding" not in VARIANTS[n]]
for name in chosen:
    sections = VARIANTS[name]
    run = f"{args.out}/{name}"
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    demo.grpo_stage(args.demo, demo.FULL, progress=False, run_dir=run, **sections)
    seconds = time.perf_counter() - t0
    hf = export_run(run, f"{run}/hf")
    texts = greedy(from_pretrained(hf))
    acc = sum(t.strip() == r["completion"] for t, r in zip(texts, held)) / len(held)
    series = collect_series(read_metrics(f"{run}/metrics.jsonl"))
    mean = lambda k, series=series: float(np.mean(series[k][1])) if k in series else None  # noqa: E731
    result["variants"][name] = {
        "held_out_accuracy": acc, "seconds": round(seconds, 1), "generate_s_per_step": mean("time/generate_s"),
        "logp_difference_mean": mean("sampling/sampling_logp_difference/mean"),
        "logp_difference_max": mean("sampling/sampling_logp_difference/max"),
        "mismatch_kl": mean("sampling/mismatch_kl"), "last_eval_pass@1": series["eval_pass@1"][1][-1],
        "version_lag_max": max(series["rollout/version_lag_max"][1]) if "rollout/version_lag_max" in series else 0}
    print(json.dumps({name: result["variants"][name]}), flush=True)

if not args.no_speed:
    model = from_pretrained(f"{args.demo}/sft/hf")
    prompts = [tok.encode(r["prompt"]) for r in held]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=8, stop_ids=tok.eos_ids)
    samplers = {dt: Sampler(model, max_len=24, pad_id=tok.pad_id, dtype=dt) for dt in ("float32", "bfloat16")}
    times = {dt: [] for dt in samplers}
    for s in samplers.values():
        s.generate(prompts, params)  # compile
    for _ in range(args.rounds):
        for dt, s in samplers.items():
            t0 = time.perf_counter()
            jax.block_until_ready(s.generate(prompts, params, key=jax.random.key(1)).tokens)
            times[dt].append(time.perf_counter() - t0)
    med = {dt: statistics.median(v) for dt, v in times.items()}
    result["generate_200x8_s"] = med
    result["bf16_over_f32_time"] = round(med["bfloat16"] / med["float32"], 3)
print(json.dumps(result))
if args.json:
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=2)

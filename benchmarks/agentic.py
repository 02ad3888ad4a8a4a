#!/usr/bin/env python
"""The tool-use learning recipe (issue #13), end to end on a CPU: held-out accuracy and tool use before / after GRPO.

1. `demos.agentic.prepare(out)`: `tool_arithmetic` data (3-digit products; 2000 training prompts,
   200 held-out) and demo-tiny SFT-ed from scratch on episodes that call the calculator for half of
   the problems and guess the answer for the others (tool outputs never trained);
2. episodes on the held-out problems (`agentic.rollout.evaluate`), greedy (the headline) and sampled at
   temperature 1: accuracy, tool-use rate, accuracy of the episodes that called the tool;
3. `posttrain grpo --config configs/grpo_agentic.yaml` (LoRA, the calculator, episodes of up to 3
   actions, the verifier's reward), exported;
4. the same evaluation of the export.
Writes JSON (before / after accuracy and tool-use rate, the sampled reward and tool-use rate of the
first and last logged GRPO steps, steps, wall seconds per stage). Never part of the test run.

Usage: .venv/bin/python benchmarks/agentic.py [--out runs/agentic] [--sft-steps 300] [--grpo-steps 30]
       [--tool-fraction 0.5] [--json out.json]
"""

import argparse
import json
import os
import shutil
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="runs/agentic")
ap.add_argument("--config", default="configs/grpo_agentic.yaml")
ap.add_argument("--sft-steps", type=int, default=None)
ap.add_argument("--grpo-steps", type=int, default=None)
ap.add_argument("--tool-fraction", type=float, default=0.5)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--eval", type=int, default=200, help="held-out problems to evaluate")
ap.add_argument("--skip-sft", action="store_true", help="reuse <out>/sft/hf")
ap.add_argument("--json", default=None)
ap.add_argument("overrides", nargs="*", help="dotted overrides of the GRPO config")
args = ap.parse_args()

import posttrain  # noqa: E402,F401  (first: CPU XLA defaults before JAX starts)
from posttrain import config as C  # noqa: E402
from posttrain.agentic.rollout import evaluate  # noqa: E402
from posttrain.demos import agentic as recipe  # noqa: E402
from posttrain.models import from_pretrained  # noqa: E402
from posttrain.runs import export_run  # noqa: E402
from posttrain.tasks import tool_arithmetic as task  # noqa: E402
from posttrain.tokenizer import byte_tokenizer  # noqa: E402
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer  # noqa: E402

out, t_all = args.out, time.perf_counter()
times = {}
t0 = time.perf_counter()
if args.skip_sft:
    data = recipe.write_data(out)
    hf = os.path.join(out, "sft", "hf")
else:
    prep = recipe.prepare(out, tool_fraction=args.tool_fraction, sft_steps=args.sft_steps, seed=args.seed)
    data, hf = prep["data"], prep["model"]
times["sft_s"] = round(time.perf_counter() - t0, 1)
over = [f"model.path={hf}", f"data.train={out}/data/prompts.jsonl", f"run_dir={out}/grpo",
        *([f"train.steps={args.grpo_steps}"] if args.grpo_steps else []), *args.overrides]
cfg = C.load(GRPOConfig, args.config, over)
env, g = cfg.env, cfg.grpo
tok = byte_tokenizer()
rows = data.eval_prompts[:args.eval]


def score(model, sampler=None):
    """Greedy accuracy / tool use, and the same with sampling (temperature 1, what GRPO sees)."""
    out = {}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        r = evaluate(model, tok, rows, lambda: task.make_env(max_turns=env.max_turns, fmt=env.format),
                     max_new_tokens=g.max_new_tokens, max_tokens=env.max_tokens, max_turns=env.max_turns,
                     fmt=env.format, temperature=temperature, sampler=sampler)
        sampler = r["sampler"]
        used = [e for e in r["episodes"] if e.tool_calls]
        out[name] = {k: round(r[k], 4) for k in ("accuracy", "tool_use_rate", "turns", "truncated")}
        out[name]["accuracy_when_calling"] = round(sum(e.reward for e in used) / max(1, len(used)), 4)
    return out, sampler


t0 = time.perf_counter()
before, sampler = score(from_pretrained(hf))
times["eval_before_s"] = round(time.perf_counter() - t0, 1)
print(f"[agentic] before GRPO: {before}", flush=True)
shutil.rmtree(cfg.run_dir, ignore_errors=True)
t0 = time.perf_counter()
GRPOTrainer(cfg).train()
times["grpo_s"] = round(time.perf_counter() - t0, 1)
after_hf = export_run(cfg.run_dir, os.path.join(cfg.run_dir, "hf"))
t0 = time.perf_counter()
after, _ = score(from_pretrained(after_hf), sampler)
times["eval_after_s"] = round(time.perf_counter() - t0, 1)
print(f"[agentic] after GRPO: {after}", flush=True)
logged = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
curve = [{k: round(m[k], 3) for k in ("step", "reward/mean", "episode/tool_use_rate") if k in m} for m in logged]
gain = lambda k: round(100 * (after["greedy"][k] - before["greedy"][k]), 1)  # noqa: E731
result = {"before": before, "after": after, "accuracy_gain_points": gain("accuracy"),
          "tool_use_gain_points": gain("tool_use_rate"), "grpo_steps": cfg.train.steps,
          "prompts_per_step": cfg.train.batch_size, "episodes_per_prompt": g.num_generations, "held_out": len(rows),
          "sampled_curve": curve, "seconds": {**times, "total": round(time.perf_counter() - t_all, 1)},
          "command": " ".join([sys.executable, *sys.argv])}
print(json.dumps(result, indent=2))
if args.json:
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=2)

#!/usr/bin/env python
"""Speed on the real model: posttrain against TRL and transformers on SmolLM2-135M-Instruct, same run.

The peers' side is ../shared/anchors: `setup.sh` (their venv), `real_model.sh CKPT` (the SmolLM2 GGUF converted
by transformers' own GGUF loader: the folder all three load), `trl_bench.py --existing` and `hf_bench.py
--existing`. Each round runs, one process after another through `with_rss.py` (peak RSS of each process):
  TRL GRPOTrainer step      --batch 8 completions = 2 prompts x 4, --prompt 16 numbers (TRL records the token
                            count), exactly --new-grpo completion tokens, beta 0, full fine-tune (TRL's default);
  posttrain GRPO step       benchmarks/grpo.py, the same shapes (prompt = TRL's mean prompt token count), full
                            fine-tune, and LoRA rank 16 beside it;
  transformers `generate`   greedy, batch 8, 64-token prompts, exactly 128 new tokens;
  posttrain generate        benchmarks/generate.py, the same.
The order of the jobs alternates between rounds (interleaved); figures are medians over rounds of each
process's own median. Writes one JSON (medians, ratios, peak RSS, every round's raw figures, `lscpu`'s model
name) and prints a table.

Usage: .venv/bin/python benchmarks/real.py [--rounds 3] [--only generate] [--threads 2]
                                          [--ckpt /tmp/smollm2-135m-instruct]
                                          [--out runs/bench-real] [--json runs/bench-real/real.json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ANCHORS = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "anchors"))


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def job(name: str, script: str, argv: list[str], out: str, threads: int) -> dict:
    path = os.path.join(out, f"{name}.json")
    cmd = [sys.executable, os.path.join(HERE, "with_rss.py"), script, "--threads", str(threads), "--json", path, *argv]
    print(f"[real] {name}: {' '.join(cmd[2:])}", flush=True)
    done = subprocess.run(cmd, env={**os.environ, "PROJECT_PY_REAL": sys.executable})
    if done.returncode != 0 or not os.path.isfile(path):
        raise SystemExit(f"[real] {name} failed (exit {done.returncode}); see its output above")
    with open(path) as fh:
        res = json.load(fh)
    for key in ("grpo_error", "dpo_error"):
        if key in res:
            raise SystemExit(f"[real] {name}: {res[key]}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--ckpt", default="/tmp/smollm2-135m-instruct")
    ap.add_argument("--out", default="runs/bench-real")
    ap.add_argument("--json", default=None, help="default: <out>/real.json")
    ap.add_argument("--new-grpo", type=int, default=16, help="completion tokens per GRPO sample")
    ap.add_argument("--steps", type=int, default=4, help="GRPO steps per process (the first is dropped)")
    ap.add_argument("--only", choices=("all", "generate"), default="all",
                    help="generate: the two generation jobs only (no GRPO steps)")
    a = ap.parse_args()
    subprocess.run(["bash", os.path.join(ANCHORS, "setup.sh")], check=True)
    subprocess.run(["bash", os.path.join(ANCHORS, "real_model.sh"), a.ckpt], check=True)
    vocab = json.load(open(os.path.join(a.ckpt, "config.json")))["vocab_size"]
    grpo = ["--batch", "8", "--num-generations", "4", "--max-completion", str(a.new_grpo), "--steps", str(a.steps)]
    gen = ["--batch", "8", "--prompt", "64", "--new", "128"]
    trl = os.path.join(ANCHORS, "trl_bench.py")
    hf = os.path.join(ANCHORS, "hf_bench.py")
    rounds, prompt = [], None
    for r in range(a.rounds):
        out = os.path.join(a.out, f"round{r}")
        os.makedirs(out, exist_ok=True)
        res = {}
        if prompt is None and a.only == "generate":
            prompt = 16
        if prompt is None:  # TRL first: its tokenizer gives the prompt length posttrain's random prompts take
            res["trl_grpo"] = job("trl_grpo", trl, ["--existing", "--ckpt", a.ckpt, "--skip", "dpo", "--prompt", "16",
                                                    *grpo], out, a.threads)
            prompt = round(res["trl_grpo"]["grpo_prompt_tokens_mean"])
        ours = ["--ckpt", a.ckpt, "--vocab", str(vocab), "--prompt", str(prompt), *grpo]
        jobs = [("posttrain_grpo_full", os.path.join(HERE, "grpo.py"), ours),
                ("posttrain_grpo_lora16", os.path.join(HERE, "grpo.py"), [*ours, "--lora", "16"]),
                ("trl_grpo", trl, ["--existing", "--ckpt", a.ckpt, "--skip", "dpo", "--prompt", "16", *grpo]),
                ("posttrain_generate", os.path.join(HERE, "generate.py"),
                 ["--ckpt", a.ckpt, "--vocab", str(vocab), "--only-batch", "--reps", "3", *gen]),
                ("hf_generate", hf, ["--existing", "--ckpt", a.ckpt, "--steps", "2", "--seq", "64", "--reps", "3",
                                     *gen])]
        if a.only == "generate":
            jobs = [j for j in jobs if j[0].endswith("generate")]
        for name, script, argv in (jobs if r % 2 else jobs[::-1]):
            if name not in res:
                res[name] = job(name, script, argv, out, a.threads)
        rounds.append(res)

    def med(name, key):
        vals = [r[name][key]["median"] if isinstance(r[name][key], dict) else r[name][key] for r in rounds]
        return statistics.median(vals)

    def rss(name):
        return statistics.median(r[name].get("peak_rss_bytes", 0) for r in rounds) / 2 ** 30

    s = {"hf_gen_tok_s": med("hf_generate", "gen_tok_s"), "posttrain_gen_tok_s": med("posttrain_generate", "gen_tok_s")}
    ratios = {"generate_speedup_vs_transformers": s["posttrain_gen_tok_s"] / s["hf_gen_tok_s"]}
    if a.only == "all":
        s.update(trl_grpo_step_s=med("trl_grpo", "grpo_step_s"),
                 posttrain_grpo_step_s=med("posttrain_grpo_full", "grpo_step_s"),
                 posttrain_grpo_lora16_step_s=med("posttrain_grpo_lora16", "grpo_step_s"))
        ratios.update(grpo_full_speedup_vs_trl=s["trl_grpo_step_s"] / s["posttrain_grpo_step_s"],
                      grpo_lora16_speedup_vs_trl=s["trl_grpo_step_s"] / s["posttrain_grpo_lora16_step_s"])
    summary = {
        "cpu": cpu_model(), "threads": a.threads, "rounds": a.rounds, "ckpt": a.ckpt,
        "shapes": {"grpo": {"completions": 8, "num_generations": 4, "prompt_tokens": prompt,
                            "completion_tokens": a.new_grpo},
                   "generate": {"batch": 8, "prompt": 64, "new": 128, "greedy": True}},
        "medians": s,
        "ratios": ratios,
        "peak_rss_gib": {n: rss(n) for n in rounds[0]},
        "raw": rounds}
    path = a.json or os.path.join(a.out, "real.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump(summary, fh, indent=2)
    print(f"\nSmolLM2-135M-Instruct, {a.threads} threads, {summary['cpu']}, medians of {a.rounds} interleaved rounds")
    if a.only == "all":
        print(f"GRPO step (8 = 2 x 4 samples, {prompt} + {a.new_grpo} tokens): TRL {s['trl_grpo_step_s']:.2f} s, "
              f"posttrain full {s['posttrain_grpo_step_s']:.2f} s "
              f"({ratios['grpo_full_speedup_vs_trl']:.2f}x), LoRA 16 {s['posttrain_grpo_lora16_step_s']:.2f} s "
              f"({ratios['grpo_lora16_speedup_vs_trl']:.2f}x)")
    print(f"generate (greedy, 8 x (64 + 128)): transformers {s['hf_gen_tok_s']:.0f} tok/s, posttrain "
          f"{s['posttrain_gen_tok_s']:.0f} tok/s ({summary['ratios']['generate_speedup_vs_transformers']:.2f}x)")
    print("peak RSS (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in summary["peak_rss_gib"].items()))
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Same-run ratios from a ../shared/anchors/run_all.sh output folder (one JSON per script and round).

For each round r it divides posttrain's figure by the anchor's figure of the SAME round (the
machines drift 15-35 % between runs, so only same-run ratios mean anything), then prints the
per-round ratios and their median as a Markdown table.

Usage: python benchmarks/ratios.py /tmp/bench-out
"""

import glob
import json
import os
import re
import statistics
import sys

# (label, posttrain script, posttrain key, anchor script, anchor key, higher is better)
PAIRS = [
    ("generate 8x(64+128) vs Tunix Sampler", "generate", "gen_tok_s", "tunix_bench", "gen_tok_s", True),
    ("generate 8x(64+128) vs HF generate", "generate", "gen_tok_s", "hf_bench", "gen_tok_s", True),
    ("generate batch 32 vs Tunix Sampler batch 8", "generate", "gen_tok_s_b32", "tunix_bench", "gen_tok_s", True),
    ("train 8x256 vs Tunix PeftTrainer", "train", "train_tok_s", "tunix_bench", "peft_train_tok_s", True),
    ("train 8x256 vs HF + PyTorch", "train", "train_tok_s", "hf_bench", "train_tok_s", True),
]


def load(folder):
    runs = {}
    for f in glob.glob(os.path.join(folder, "*.r*.json")):
        m = re.match(r"(.+)\.r(\d+)\.json$", os.path.basename(f))
        runs.setdefault(m.group(1), {})[int(m.group(2))] = json.load(open(f))
    return runs


def main(folder):
    runs = load(folder)
    rows = ["| comparison | posttrain (median) | anchor (median) | ratio per round | median ratio |",
            "|---|---|---|---|---|"]
    for label, ours, ok, ref, rk, _ in PAIRS:
        if ours not in runs or ref not in runs:
            continue
        rounds = sorted(set(runs[ours]) & set(runs[ref]))
        pairs = [(runs[ours][r].get(ok), runs[ref][r].get(rk)) for r in rounds]
        pairs = [(a, b) for a, b in pairs if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b]
        if not pairs:
            continue
        ratios = [a / b for a, b in pairs]
        rows.append(f"| {label} | {statistics.median(a for a, _ in pairs):.0f} | "
                    f"{statistics.median(b for _, b in pairs):.0f} | {' / '.join(f'{x:.2f}' for x in ratios)} | "
                    f"**{statistics.median(ratios):.2f}x** |")
    extra = [("generate", "group8_vs_independent", "n=8 group of one prompt / 8 independent prompts (time)"),
             ("train", "mfu", "train MFU (of the in-process f32 matmul peak)")]
    for script, key, label in extra:
        vals = [r.get(key) for r in runs.get(script, {}).values() if isinstance(r.get(key), (int, float))]
        if vals:
            rows.append(f"| {label} | {statistics.median(vals):.3f} | | {' / '.join(f'{v:.3f}' for v in vals)} | |")
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/anchor-results")

#!/usr/bin/env bash
# `make bench`: posttrain against Tunix, TRL and transformers + PyTorch on the anchors' tiny Llama, in one
# invocation, then the tables of docs/benchmarks.md and the scaling plot docs/bench_scaling.png.
#   1. the reference venv (../shared/anchors/setup.sh; ~100 s the first time, then a check);
#   2. ../shared/anchors/run_all.sh with posttrain's scripts in BENCHES: every script, the peers' and
#      posttrain's, ROUNDS times, one after another, interleaved (never two at once: 2 cores), each through
#      benchmarks/with_rss.py (its peak resident memory into its JSON);
#   3. benchmarks/ratios.py: same-round speed-ups, goals, MFU, peak RSS and the machine, written into
#      docs/benchmarks.md between its "make bench" markers;
#   4. benchmarks/sweep.py: tokens/s and peak RSS against length (posttrain, PyTorch, Tunix), batch size and
#      new tokens (posttrain, PyTorch), one round, plotted into docs/bench_scaling.png;
#   5. benchmarks/prefix_sweep.py: DPO and GRPO steps with and without prefix-shared rows as the prompt grows
#      64 -> 1024 tokens, one round: docs/prefix_scaling.png and its table in docs/benchmarks.md.
# Usage: make bench [ROUNDS=2] [OUT=/tmp/posttrain-bench]  (30-42 minutes on 2 cores with ROUNDS=2)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ANCHORS="${ANCHORS:-$ROOT/../shared/anchors}"
OUT="${OUT:-/tmp/posttrain-bench}"; ROUNDS="${ROUNDS:-2}"; THREADS="${THREADS:-2}"
cd "$ROOT"
bash "$ANCHORS/setup.sh"
rm -rf "$OUT"; mkdir -p "$OUT"
OURS="benchmarks/train.py benchmarks/generate.py benchmarks/dpo.py benchmarks/grpo.py benchmarks/ppo.py benchmarks/distill.py"
# The rounds share one JAX compilation cache, new each run: round 1 compiles every program (posttrain's and
# Tunix's) and later rounds load the same executables, so compiling is paid once. Step times are unchanged
# (they exclude the first, compiling step); a table's peak RSS is the largest over rounds, a compiling one.
# The sweeps below run without it: their shapes differ, and each point's RSS stays a compiling process's.
JAX_COMPILATION_CACHE_DIR="$OUT/jax-cache" \
  BENCHES="cpu_peak hf_bench tunix_bench trl_bench tunix_rl_bench $OURS" PY="$ROOT/benchmarks/with_rss.py" \
  PROJECT_PY="$ROOT/benchmarks/with_rss.py" PROJECT_PY_REAL="$ROOT/.venv/bin/python" \
  bash "$ANCHORS/run_all.sh" "$OUT" "$ROUNDS" "$THREADS"
.venv/bin/python benchmarks/ratios.py "$OUT" --docs docs/benchmarks.md --command "make bench ROUNDS=$ROUNDS"
.venv/bin/python benchmarks/sweep.py --out "$OUT/sweep" --rounds 1 --threads "$THREADS" --reps 2 \
  --train 8x128 4x512 1x2048 --gen 8x64 2x1024 --train-batch 2x128 8x128 16x128 --gen-batch 1x64 8x64 32x64 \
  --gen-new 8x64+32 8x64 8x64+256 --extra-libs posttrain torch --plot docs/bench_scaling.png --docs docs/benchmarks.md
.venv/bin/python benchmarks/prefix_sweep.py --out "$OUT/prefix" --rounds 1 --threads "$THREADS" \
  --prompts 64 256 1024 --plot docs/prefix_scaling.png --docs docs/benchmarks.md
echo "tables: docs/benchmarks.md (make bench sections); plots: docs/bench_scaling.png, docs/prefix_scaling.png; raw: $OUT"

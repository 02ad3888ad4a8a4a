#!/usr/bin/env bash
# The tiny Qwen3-MoE of the anchors (8 experts of width 256, top-2; ../shared/anchors/hf_bench.py --experts 8)
# trained and decoded by transformers + PyTorch and by posttrain, interleaved, ROUNDS rounds, one process at
# a time; prints the median tokens/s of each side and their ratio (only same-run ratios count).
# Usage: bash benchmarks/moe.sh [OUTDIR=/tmp/moe-bench] [ROUNDS=3] [THREADS=2]
set -eu
OUT="${1:-/tmp/moe-bench}"; ROUNDS="${2:-3}"; THREADS="${3:-2}"
HERE="$(cd "$(dirname "$0")" && pwd)"
ANCHORS="$HERE/../../shared/anchors"
PY="${PY:-${ANCHOR_VENV:-/tmp/anchor-venv}/bin/python}"; PROJECT_PY="${PROJECT_PY:-.venv/bin/python}"
CKPT="$OUT/tiny-moe"; FLAGS="--threads $THREADS --experts 8 --ckpt $CKPT"
mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  "$PY" "$ANCHORS/hf_bench.py" $FLAGS --json "$OUT/hf.r$r.json" > "$OUT/hf.r$r.log" 2>&1   # builds $CKPT first
  "$PROJECT_PY" "$HERE/train.py" $FLAGS --json "$OUT/train.r$r.json" > "$OUT/train.r$r.log" 2>&1
  "$PROJECT_PY" "$HERE/generate.py" $FLAGS --json "$OUT/generate.r$r.json" > "$OUT/generate.r$r.log" 2>&1
  echo "round $r done"
done
"$PROJECT_PY" - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
load = lambda name: [json.load(open(f"{out}/{name}.r{r}.json")) for r in range(1, rounds + 1)]
hf, tr, ge = load("hf"), load("train"), load("generate")
def find(d, *keys):  # the first key present (the anchors' and posttrain's JSON share the tok/s names)
    for k in keys:
        if k in d:
            return d[k]
    raise KeyError(f"none of {keys} in {sorted(d)}")
rows = [("train tok/s", [find(h, "train_tok_s") for h in hf], [t["train_tok_s"] for t in tr]),
        ("generate new tok/s", [find(h, "gen_tok_s", "generate_tok_s") for h in hf], [find(g, "gen_tok_s", "generate_tok_s") for g in ge])]
for name, a, b in rows:
    ratios = [y / x for x, y in zip(a, b)]
    print(f"{name:20s} transformers {statistics.median(a):9.0f}  posttrain {statistics.median(b):9.0f}  "
          f"ratio (median of per-round) {statistics.median(ratios):.2f}x  rounds {[round(x, 2) for x in ratios]}")
PY

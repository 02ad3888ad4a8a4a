#!/usr/bin/env bash
# posttrain beside Tunix (google-tunix 0.1.7) on one TPU chip, one call: each side in its own process (one program
# at a time may hold the chip), Tunix through the reference scripts of ../shared/anchors (tunix_bench.py,
# tunix_rl_bench.py, unchanged), posttrain through benchmarks/tpu.py at the same model shape and dtype.
#   bash benchmarks/tpu_tunix.sh OUTDIR [PART ...]      parts: train train2k train4k sample grpo (default: train sample grpo)
# GRPO_DTYPE=bfloat16: posttrain's GRPO side in bfloat16 (Tunix's stays float32, its only dtype).
# Before it: scripts/tpu.sh has installed posttrain's dependencies on this machine (TPU_SITE), .whl-tunix/ holds
# Tunix's wheels that the machine's index lacks (`bash scripts/tpu_wheels.sh tunix` where PyPI is reachable) and
# .anchors/ a copy of ../shared/anchors (both folders are git-ignored: carry them). Results: OUTDIR/tunix.jsonl
# (one JSON line per Tunix run) and OUTDIR/bench.jsonl (posttrain's), logs beside them.
#
# The shapes (Tunix's llama3 has float32 parameters only, an untied head, no remat by default):
#   train   the llama3-1b layer shape cut to 4 layers and a 32,768 vocabulary (376 M parameters: float32 AdamW
#           for the full 1.24 B model needs 20 GB), 4 x 1024 tokens, float32: Tunix's PeftTrainer and its plain
#           nnx.value_and_grad step against posttrain's train step
#   train2k the same at 2 x 2048 tokens (Tunix's attention builds the [T, T] scores; posttrain's is splash)
#   train4k 1 x 4096 tokens on 2 of those layers (4 layers of Tunix's [32, 4096, 4096] float32 scores do not fit
#           beside float32 AdamW)
#   sample  the whole llama3-1b shape with an untied head (1.50 B), 128 prompt + 512 greedy new tokens: Tunix's
#           Sampler at 32 rows, float32 (64 rows do not fit it), against posttrain's Sampler at 256 rows, bf16
#   grpo    the train shape, 8 prompts x 8 samples x 128 new tokens, prompt 128, float32, beta 0, reward = the
#           fraction of even token ids (tunix_rl_bench's): Tunix's GRPOLearner (RLCluster, vanilla rollout) against
#           posttrain's GRPO trainer
set -uo pipefail
OUT=${1:?usage: bash benchmarks/tpu_tunix.sh OUTDIR [PART ...]}; shift
PARTS=${*:-train sample grpo}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
SITE=${TPU_SITE:-/tmp/site}
TSITE=${TUNIX_SITE:-/tmp/tunix-site}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false JAX_PLATFORMS=${JAX_PLATFORMS:-tpu}
LIMIT=${TPU_SECTION_S:-240}
if [ ! -d "$TSITE/tunix" ]; then  # Tunix and what it imports, beside (never over) posttrain's and the machine's own
  t0=$SECONDS
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-compile --no-cache-dir \
    --only-binary=:all: --target "$TSITE" --index-url file:///opt/pypi/simple --find-links .whl-tunix \
    google-tunix==0.1.7 clu google-metrax perfetto simplejson humanize treescope wrapt jaxtyping wadler-lindig \
    sentencepiece > "$OUT/tunix_install.log" 2>&1
  echo "tunix install: rc $? in $((SECONDS - t0)) s"
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE:$PWD
SMALL_T="--vocab 32768 --layers 4 --hidden 2048 --heads 32 --kv-heads 8 --mlp 8192"
SMALL_P="num_layers=4,vocab_size=32768,tie_embeddings=false"
TWO_T="--vocab 32768 --layers 2 --hidden 2048 --heads 32 --kv-heads 8 --mlp 8192"
TWO_P="num_layers=2,vocab_size=32768,tie_embeddings=false"
BIG_T="--vocab 128256 --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --mlp 8192"
BIG_P="tie_embeddings=false"

tunix() {  # NAME SCRIPT ARGS...: one Tunix process, its RESULT_JSON line appended to tunix.jsonl
  local name=$1 script=$2; shift 2
  local t0=$SECONDS
  PYTHONPATH=$PYTHONPATH:$TSITE timeout "$LIMIT" python3 ".anchors/$script" --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "tunix $name: rc $? in $((SECONDS - t0)) s: $(grep -E '^\[tunix' "$OUT/$name.log" | tr '\n' ' ' | cut -c1-300)"
  [ -s "$OUT/$name.json" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['run']=sys.argv[2]; \
print(json.dumps(d))" "$OUT/$name.json" "$name" >> "$OUT/tunix.jsonl"
}
posttrain() {  # SECTION ARGS...: one benchmarks/tpu.py process
  local t0=$SECONDS
  timeout "$LIMIT" python3 benchmarks/tpu.py --only "$@" --jsonl "$OUT/bench.jsonl" >> "$OUT/bench.log" 2>&1
  echo "posttrain $1: rc $? in $((SECONDS - t0)) s: $(tail -1 "$OUT/bench.jsonl" 2>/dev/null | cut -c1-300)"
}

for part in $PARTS; do
  case $part in
    train)
      tunix train tunix_bench.py $SMALL_T --batch 4 --seq 1024 --steps 5 --reps 3 --skip gen
      posttrain sft:4:1024:1:none --shape "$SMALL_P" --dtype float32 ;;
    train2k)  # seq 2048 (issue #51's length), 2 rows; each Tunix step in its own process (both do not fit at once)
      tunix train2k_peft tunix_bench.py $SMALL_T --batch 2 --seq 2048 --steps 5 --reps 3 --skip gen,plain
      tunix train2k_plain tunix_bench.py $SMALL_T --batch 2 --seq 2048 --steps 5 --reps 3 --skip gen,peft
      posttrain sft:2:2048:1:none --shape "$SMALL_P" --dtype float32 ;;
    train4k)
      tunix train4k_peft tunix_bench.py $TWO_T --batch 1 --seq 4096 --steps 5 --reps 3 --skip gen,plain
      tunix train4k_plain tunix_bench.py $TWO_T --batch 1 --seq 4096 --steps 5 --reps 3 --skip gen,peft
      posttrain sft:1:4096:1:none --shape "$TWO_P" --dtype float32 ;;
    sample)
      tunix sample tunix_bench.py $BIG_T --batch 32 --prompt 128 --new 512 --reps 3 --skip peft,plain
      posttrain sample:256:128:512 --shape "$BIG_P" --dtype bfloat16 --steps 3 ;;
    grpo)
      tunix grpo tunix_rl_bench.py $SMALL_T --batch 64 --num-generations 8 --prompt 128 --max-completion 128 \
        --steps 5 --skip dpo
      posttrain grpo:8:8:128:128:none --shape "$SMALL_P" --dtype "${GRPO_DTYPE:-float32}" --steps 4 ;;
    *) echo "unknown part $part (train | train2k | train4k | sample | grpo)"; exit 2 ;;
  esac
done

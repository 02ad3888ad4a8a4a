#!/usr/bin/env bash
# posttrain on a TPU machine, one command: install beside the machine's own JAX, run the TPU test tier, then the
# TPU benchmark sections; everything goes to OUTDIR (install.log, tests.log, bench.log, bench.jsonl).
#   bash scripts/tpu.sh OUTDIR [SECTION ...]          (sections: benchmarks/tpu.py; default: $DEFAULT_SECTIONS)
# Offline TPU machine: first run scripts/tpu_wheels.sh where PyPI is reachable (fills .whl-tpu/), carry .whl-tpu.
# SECTION none: install and test only. Environment: TPU_SITE (install target, default /tmp/site), TPU_TESTS=0 skips the tests, TPU_TEST_S (their time
# limit, default 540: the tier took ~470 s on a v5e at the ninth stop), TPU_TORCH=0 skips torch (the transformers comparisons then fail, not skip), TPU_CACHE (JAX's
# persistent compilation cache folder, default /tmp/posttrain-jax-cache). docs/tpu.md says more.
set -uo pipefail
OUT=${1:?usage: bash scripts/tpu.sh OUTDIR [SECTION ...]}; shift
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
SITE=${TPU_SITE:-/tmp/site}
DEFAULT_SECTIONS="peak sft:1:2048:1:none sft:16:2048:16:none grpo:8:8:128:128:none sft:4:2048:1:full sft:4:2048:1:dots sample:64:128:512 lora:8:2048:4:none"
SECTIONS=${*:-$DEFAULT_SECTIONS}  # "none": install (and the tests) only
[ "$SECTIONS" = none ] && SECTIONS=
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export JAX_PLATFORMS=${JAX_PLATFORMS:-tpu} XLA_FLAGS=${XLA_FLAGS:-}
export JAX_COMPILATION_CACHE_DIR=${TPU_CACHE:-/tmp/posttrain-jax-cache} JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1

# 1. install: each pin of requirements.lock from the machine's index (/opt/pypi/simple) or .whl-tpu, never jax,
#    jaxlib, numpy, scipy (the machine's own stay first on PYTHONPATH) nor the CPU-only test tools
{
  t0=$SECONDS
  python3 -c 'import platform, sys, jax; print("libc", platform.libc_ver(), "python", sys.version.split()[0], "jax", jax.__version__, jax.devices())'
  SKIP=" jax jaxlib numpy scipy ml-dtypes opt-einsum torch trl wandb ruff pytest pytest-xdist execnet iniconfig pluggy "
  norm() { echo "$1" | tr 'A-Z_.' 'a-z--'; }
  want=(); miss=()
  while IFS= read -r line; do
    case "$line" in \#*|"") continue;; esac
    name=${line%%==*}; ver=${line#*==}; n=$(norm "$name")
    [[ "$SKIP" == *" $n "* ]] && continue
    if ls .whl-tpu 2>/dev/null | tr 'A-Z_' 'a-z-' | grep -q "^$n-$ver-"; then want+=("$name==$ver")
    elif [ -e "/opt/pypi/simple/$n" ]; then
      if grep -rqiE -- "-$ver(-|\.tar)" "/opt/pypi/simple/$n/" 2>/dev/null; then want+=("$name==$ver")
      else want+=("$name"); echo "not the locked version (the index's instead): $name (lock $ver)"; fi
    else miss+=("$name==$ver"); fi
  done < requirements.lock
  [ ${#miss[@]} -gt 0 ] && echo "MISSING from the index and .whl-tpu (run scripts/tpu_wheels.sh): ${miss[*]}"
  if [ ! -e "$SITE/.posttrain-installed" ]; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-compile --no-cache-dir \
      --only-binary=:all: --target "$SITE" --index-url file:///opt/pypi/simple --find-links .whl-tpu "${want[@]}" \
      && touch "$SITE/.posttrain-installed"
  fi
  if [ "${TPU_TORCH:-1}" = 1 ] && [ ! -d "$SITE/torch" ]; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-compile --no-cache-dir \
      --only-binary=:all: --target "$SITE" --index-url file:///opt/pypi/simple --find-links /opt/wheels torch==2.13.0
  fi
  echo "install took $((SECONDS - t0)) s"
} > "$OUT/install.log" 2>&1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE:$PWD
python3 -c "import jax, flax, optax, grain, posttrain; print('jax', jax.__version__, jax.__file__, 'flax', flax.__version__, 'optax', optax.__version__)" >> "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 2; }
tail -3 "$OUT/install.log"

# 2. the TPU test tier (one process: one program at a time may hold the chip); float32 comparisons at HIGHEST
#    matmul precision, the knob JAX reads (models take it per config as model.matmul_precision). The TRL
#    comparisons (test_policy_losses: float64 against trl, which this install leaves out) stay on the CPU.
TIER="tests/test_attention_tpu.py tests/test_remat.py tests/test_attention.py tests/test_generate.py tests/test_models.py tests/test_chunked_logps.py tests/test_train.py"
if [ "${TPU_TESTS:-1}" = 1 ]; then
  t0=$SECONDS
  # -v: each result is in the log as it comes, so a run stopped at the time limit still counts what it ran
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${TPU_TEST_S:-540}" python3 -m pytest -v -p no:cacheprovider \
    --durations=10 ${TPU_TIER:-$TIER} > "$OUT/tests.log" 2>&1
  rc=$?
  echo "tests: rc $rc in $((SECONDS - t0)) s: $(grep -c ' PASSED' "$OUT/tests.log") passed, $(grep -c ' FAILED' \
    "$OUT/tests.log") failed, $(grep -c ' ERROR' "$OUT/tests.log") errors; $(tail -1 "$OUT/tests.log")"
fi

# 3. the benchmark sections, one process each (a clean peak_bytes_in_use each)
PEAK=${TPU_PEAK:-}  # the peak section sets it; TPU_PEAK gives a measured one without re-measuring
for s in $SECTIONS; do
  t0=$SECONDS
  timeout "${TPU_SECTION_S:-300}" python3 benchmarks/tpu.py --only "$s" --jsonl "$OUT/bench.jsonl" \
    ${PEAK:+--peak-flops $PEAK} >> "$OUT/bench.log" 2>&1
  rc=$?
  [ "$s" = peak ] && PEAK=$(python3 -c "import json,sys; print([json.loads(l) for l in open(sys.argv[1])][-1]['peak_flops'])" "$OUT/bench.jsonl" 2>/dev/null)
  echo "section $s: rc $rc in $((SECONDS - t0)) s: $(tail -1 "$OUT/bench.jsonl" 2>/dev/null | cut -c1-400)"
done

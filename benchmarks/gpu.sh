#!/usr/bin/env bash
# One benchmark for a machine with an NVIDIA GPU (issue #14): benchmarks/gpu.py on a randomly initialised
# Llama-shaped model (no download).
#
# Usage: bash benchmarks/gpu.sh [--json out.json] [gpu.py flags: --batch 4 --seq 2048 --steps 10 ...]
#        bash benchmarks/gpu.sh --dry-run [--json out.json]     (CPU, tiny model, the same code path: CI)
#
# Prints one Markdown table (metric | value | note): the device, a measured bf16 matmul peak, SFT step
# time / tokens/s / MFU of the ~1.24B llama3-1b shape (float32 params, bf16 compute), its peak device
# memory against the `posttrain plan` estimate, the same for llama3-8b on the fsdp preset when several GPUs
# are visible (else a row saying why not), GRPO rollout new tokens/s (posttrain's Sampler) and GRPO step
# time, and the wall time; --json PATH writes every number.
#
# Expected time: under 8 minutes in all (GPU_BENCH_BUDGET_S=450 s, minus the setup, is handed to gpu.py
# as --budget-s, which trims steps and skips a section that cannot fit); --dry-run: under a minute on CPU.
# Setup: uses .venv when its JAX sees a GPU, else creates $GPU_VENV (default .venv-gpu) with
# `pip install -e '.[cuda]'` (jax[cuda12]; needs network on first use, a few minutes of the budget).
set -euo pipefail
cd "$(dirname "$0")/.."

dry=0
for a in "$@"; do
  if [ "$a" = "--dry-run" ]; then dry=1; fi
done

if [ "$dry" = 1 ]; then
  export JAX_PLATFORMS=cpu
  exec "${PY:-.venv/bin/python}" benchmarks/gpu.py "$@"
fi

start=$SECONDS
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"  # gpu.py fits to this limit
unset JAX_PLATFORMS  # let JAX pick the GPU
has_gpu() { [ -x "$1" ] && "$1" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' >/dev/null 2>&1; }

PY="${PY:-.venv/bin/python}"
if ! has_gpu "$PY"; then
  VENV="${GPU_VENV:-.venv-gpu}"
  PY="$VENV/bin/python"
  if ! has_gpu "$PY"; then
    echo "gpu.sh: JAX sees no GPU in the existing venv; installing posttrain[cuda] into $VENV" >&2
    [ -x "$PY" ] || python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q -e '.[cuda]'
    if ! has_gpu "$PY"; then
      echo "gpu.sh: JAX in $VENV still sees no GPU (check nvidia-smi and the CUDA 12 driver)" >&2
      exit 1
    fi
  fi
fi

budget=$(( ${GPU_BENCH_BUDGET_S:-450} - (SECONDS - start) ))
if [ "$budget" -lt 120 ]; then budget=120; fi
exec "$PY" benchmarks/gpu.py --budget-s "$budget" "$@"

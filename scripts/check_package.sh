#!/usr/bin/env bash
# Release check (make package): build the sdist and wheel, `twine check` them, make sure the wheel holds no
# tests, runs or caches, install the wheel into a fresh venv (no --system-site-packages; wheels come from
# pip's cache) and run `posttrain --version`, `posttrain --help`, `posttrain generate` on a tiny local folder
# and a 3-step `posttrain sft` there.
#   PRE="transformers==X"  packages installed into the fresh venv BEFORE the wheel: pip must keep them
#                          (the acceptance check "a user's newer allowed transformers / older allowed jax stays").
set -euo pipefail
PY=${PY:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d /tmp/posttrain-pkg.XXXX)
trap 'rm -rf "$W"' EXIT
t0=$(date +%s)
$PY -m venv "$W/tools"
"$W/tools/bin/pip" install -q build twine
"$W/tools/bin/python" -m build -q --outdir "$W/dist" "$ROOT" >/dev/null
"$W/tools/bin/twine" check --strict "$W"/dist/*
WHEEL=$(ls "$W"/dist/posttrain-*.whl)
if "$W/tools/bin/python" -m zipfile -l "$WHEEL" | grep -E "(^|/)(tests|runs|benchmarks)/|__pycache__|\.pyc|\.ipynb_checkpoints"; then
  echo "check_package: the wheel holds tests, runs or caches (above)" >&2; exit 1
fi
"$W/tools/bin/python" -m zipfile -l "$WHEEL" | grep "posttrain/py.typed" >/dev/null  # not -q: an early exit breaks the pipe
$PY -m venv "$W/venv"
if [ -n "${PRE:-}" ]; then "$W/venv/bin/pip" install -q $PRE; fi
"$W/venv/bin/pip" freeze > "$W/before.txt"
"$W/venv/bin/pip" install -q "$WHEEL"
if [ -n "${PRE:-}" ]; then  # the user's versions stay
  for req in $PRE; do grep -qix "$req" <("$W/venv/bin/pip" freeze) || { echo "check_package: $req was replaced" >&2; exit 1; }; done
fi
cd "$W"
BIN="$W/venv/bin"
"$BIN/posttrain" --version
"$BIN/posttrain" --help >/dev/null
"$BIN/python" - <<'PY'
from flax import nnx
from posttrain.models import Transformer, preset, save_pretrained
from posttrain.tokenizer import byte_tokenizer
tok = byte_tokenizer()
save_pretrained(Transformer(preset("demo-tiny", vocab_size=tok.vocab_size), rngs=nnx.Rngs(0)), "tiny", tokenizer=tok)
PY
"$BIN/posttrain" generate --model tiny --prompt x --max-new-tokens 2
"$BIN/python" -X importtime -m posttrain.cli generate --model tiny --prompt x --max-new-tokens 1 2> importtime.txt >/dev/null
if grep -qE "\| +(torch|transformers)$" importtime.txt; then echo "check_package: generate imported torch" >&2; exit 1; fi
mkdir -p data && cp "$ROOT/tests/data/sft_prompt_completion.jsonl" data/
"$BIN/posttrain" sft --config "$ROOT/configs/sft_tiny.yaml" data.train=data/sft_prompt_completion.jsonl \
  train.steps=3 train.log_every=1 optim.warmup_steps=1 run_dir=runs/sft3
echo "check_package: ok in $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# Release check (make package, part of make test): build the sdist and wheel, `twine check` them, make sure
# the wheel holds no tests, runs or caches; then a fresh venv (no --system-site-packages; wheels come from
# pip's cache) that already holds the LOWEST versions pyproject.toml allows for jax, jaxlib, flax, optax,
# orbax-checkpoint, transformers, tokenizers and safetensors (a user's older stack), the wheel installed on top
# (pip must keep them), `posttrain --version`, `--help`, `generate` on a tiny local folder (no torch imported) and
# a 3-step `posttrain sft` there; last, the test extras and a smoke subset of the tests (the tokenizer tests among
# them) on those versions. Then the same in a second venv that holds the NEWEST transformers, tokenizers and
# safetensors the index serves (asked with `pip index versions`), so both ends of those ranges are tested.
# The two venvs are built and tested at the same time (each mostly one core of pip, and `make test` runs this
# before its pytest), each into its own log, printed whole when it ends; pip installs skip the byte-compilation
# of every installed file (--no-compile: Python compiles what is imported, as it runs).
#   PRE="transformers==X ..."     install these before the wheel instead of the lowest versions.
#   NEWEST="transformers==X ..."  the second venv's versions instead of the index's newest; NEWEST=none skips it.
set -euo pipefail
PY=${PY:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d /tmp/posttrain-pkg.XXXX)
trap 'rm -rf "$W"' EXIT
t0=$(date +%s)
LOWEST=$($PY - "$ROOT/pyproject.toml" <<'PY'
import re, sys
deps = re.search(r"^dependencies = \[(.*?)^\]", open(sys.argv[1]).read(), re.S | re.M).group(1)
for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "tokenizers", "safetensors"):
    m = re.search(r'"%s>=([^,"]+)' % re.escape(name), deps)
    print(f"{name}=={m.group(1)}")
PY
)
PRE=${PRE:-$(echo $LOWEST)}
$PY -m venv "$W/tools"
"$W/tools/bin/pip" install -q build twine
if [ -z "${NEWEST:-}" ]; then
  NEWEST=$(for name in transformers tokenizers safetensors; do
    v=$("$W/tools/bin/pip" index versions "$name" 2>/dev/null | sed -n "1s/^$name (\(.*\))$/\1/p")
    [ -n "$v" ] || { echo "check_package: pip index versions $name gave no version" >&2; exit 1; }
    echo "$name==$v"
  done | tr '\n' ' ')
fi
"$W/tools/bin/python" -m build -q --outdir "$W/dist" "$ROOT" >/dev/null
"$W/tools/bin/twine" check --strict "$W"/dist/*
WHEEL=$(ls "$W"/dist/posttrain-*.whl)
if "$W/tools/bin/python" -m zipfile -l "$WHEEL" | grep -E "(^|/)(tests|runs|benchmarks)/|__pycache__|\.pyc|\.ipynb_checkpoints"; then
  echo "check_package: the wheel holds tests, runs or caches (above)" >&2; exit 1
fi
"$W/tools/bin/python" -m zipfile -l "$WHEEL" | grep "posttrain/py.typed" >/dev/null  # not -q: an early exit breaks the pipe

stack() {  # stack DIR "pkg==v ...": a fresh venv holding those versions, the wheel installed beside them (pip must
  # keep them), the CLI smoke run and the smoke subset of the tests
  local V="$W/$1" pins="$2"
  $PY -m venv "$V"
  if [ -n "$pins" ]; then "$V/bin/pip" install -q --no-compile $pins; fi
  "$V/bin/pip" install -q --no-compile "$WHEEL"
  kept() {  # the user's versions stay
    "$V/bin/pip" freeze > "$V/freeze.txt"  # a file: grep -q on pip's pipe broke it (BrokenPipeError noise)
    for req in $pins; do grep -qix "$req" "$V/freeze.txt" || { echo "check_package: $req was replaced" >&2; exit 1; }; done
  }
  kept
  echo "check_package: the wheel installed beside $pins"
  local BIN="$V/bin"
  mkdir -p "$V/work" && cd "$V/work"
  "$BIN/posttrain" --version
  "$BIN/posttrain" --help >/dev/null
  "$BIN/python" - <<'PY'
from flax import nnx
from posttrain.models import Transformer, preset, save_pretrained
from posttrain.tokenizer import byte_tokenizer
tok = byte_tokenizer()
save_pretrained(Transformer(preset("demo-tiny", vocab_size=tok.vocab_size), rngs=nnx.Rngs(0)), "tiny", tokenizer=tok)
PY
  # one generate run: its output shown, its import times kept (it must not import torch or transformers)
  "$BIN/python" -X importtime -m posttrain.cli generate --model tiny --prompt x --max-new-tokens 2 2> importtime.txt || {
    grep -v "^import time:" importtime.txt >&2; exit 1; }
  if grep -qE "\| +(torch|transformers)$" importtime.txt; then echo "check_package: generate imported torch" >&2; exit 1; fi
  mkdir -p data && cp "$ROOT/tests/data/sft_prompt_completion.jsonl" data/
  "$BIN/posttrain" sft --config "$ROOT/configs/sft_tiny.yaml" data.train=data/sft_prompt_completion.jsonl \
    train.steps=3 train.log_every=1 optim.warmup_steps=1 run_dir=runs/sft3
  # the smoke subset of the tests on these versions (torch first: the local CPU wheel, never a CUDA build)
  "$BIN/pip" install -q --no-compile torch==2.13.0
  "$BIN/pip" install -q --no-compile "$WHEEL[test]"
  kept
  cd "$ROOT"
  "$BIN/python" -m pytest -q -p no:xdist -p no:cacheprovider --basetemp "$V/pytest" tests/test_tokenizer.py \
    tests/test_hf_config_json.py tests/test_xla_defaults.py "tests/test_cli.py::test_generate_chat_with_n_samples" tests/test_sft_cli.py
  echo "check_package: $pins ok ($(( $(date +%s) - t0 )) s in all so far)"
}

echo "check_package: sdist + wheel checked ($(( $(date +%s) - t0 )) s); the two venvs next"
# each stack in a background subshell (set -e holds there, as it would not in an `if`), its output in its log
( stack lowest "$PRE" ) > "$W/lowest.log" 2>&1 &
low=$!
if [ "$NEWEST" != "none" ]; then ( stack newest "$NEWEST" ) > "$W/newest.log" 2>&1 & new=$!; fi
failed=""
wait $low || failed="lowest"
cat "$W/lowest.log"
if [ "$NEWEST" != "none" ]; then
  wait $new || failed="$failed newest"
  cat "$W/newest.log"
fi
if [ -n "$failed" ]; then echo "check_package: FAILED: $failed (its log above)" >&2; exit 1; fi
echo "check_package: ok in $(( $(date +%s) - t0 )) s"

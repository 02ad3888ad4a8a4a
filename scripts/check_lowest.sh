#!/usr/bin/env bash
# make lowest: a fresh venv with the LOWEST versions pyproject.toml allows for jax, jaxlib, flax, optax,
# orbax-checkpoint and transformers (the other dependencies resolve as a user's pip would), then a small
# smoke subset of the tests. Wheels come from pip's cache when they are there.
set -euo pipefail
PY=${PY:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${LOWEST_VENV:-/tmp/posttrain-lowest}
t0=$(date +%s)
PINS=$($PY - "$ROOT/pyproject.toml" <<'PY'
import re, sys
deps = re.search(r"^dependencies = \[(.*?)^\]", open(sys.argv[1]).read(), re.S | re.M).group(1)
for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers"):
    m = re.search(r'"%s>=([^,"]+)' % re.escape(name), deps)
    print(f"{name}=={m.group(1)}")
PY
)
rm -rf "$V"
$PY -m venv "$V"
"$V/bin/pip" install -q torch==2.13.0
# shellcheck disable=SC2086
"$V/bin/pip" install -q $PINS -e "$ROOT[test]"
echo "check_lowest: installed $(echo $PINS)"
cd "$ROOT"
"$V/bin/python" -m pytest -q -p no:xdist -p no:cacheprovider tests/test_tokenizer.py tests/test_hf_config_json.py \
  tests/test_xla_defaults.py "tests/test_cli.py::test_generate_chat_with_n_samples" tests/test_sft_cli.py
echo "check_lowest: ok in $(( $(date +%s) - t0 )) s"

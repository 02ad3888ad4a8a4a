#!/usr/bin/env bash
# Run where PyPI is reachable: downloads into .whl-tpu/ (git-ignored) the wheels that an offline TPU machine's own
# package index lacks (scripts/tpu_wheels.txt: about 8 MB), for CPython 3.11 on manylinux x86-64, without their
# dependencies (each is listed). Then carry .whl-tpu with the checkout and run scripts/tpu.sh there (docs/tpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl-tpu
grep -qx '/.whl-tpu/' .git/info/exclude 2>/dev/null || echo /.whl-tpu/ >> .git/info/exclude
plat=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plat="$plat --platform $p"
done
grep -v '^#' scripts/tpu_wheels.txt | while read -r req; do
  [ -z "$req" ] && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp $plat \
    -d .whl-tpu "$req"
done
ls .whl-tpu | wc -l
du -sh .whl-tpu

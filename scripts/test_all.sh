#!/usr/bin/env bash
# `make test` after set-up and lint: the package check (scripts/check_package.sh: two venvs built and smoke-tested,
# mostly pip, about one core for 5-6 minutes) in the background at a lower priority (nice 10), beside the whole
# suite on 2 workers, so its waits on pip and the network fill the cores the suite leaves idle instead of adding
# its minutes in front of the suite. Its log is printed when both have ended; either failing fails `make test`.
#   VPY: the venv's python (the Makefile passes it); PYTEST_ARGS: extra pytest arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
VPY=${VPY:-.venv/bin/python}
LOG=$(mktemp /tmp/posttrain-package.XXXX)
t0=$SECONDS
nice -n 10 bash scripts/check_package.sh > "$LOG" 2>&1 &
pkg=$!
# shellcheck disable=SC2086
"$VPY" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 ${PYTEST_ARGS:-}
rc=$?
echo "make test: the suite ended (rc $rc) after $((SECONDS - t0)) s; waiting for the package check"
wait $pkg
prc=$?
cat "$LOG"
rm -f "$LOG"
echo "make test: package check rc $prc, suite rc $rc, $((SECONDS - t0)) s in all"
if [ $prc -ne 0 ]; then echo "make test: FAILED: the package check (its log above)" >&2; fi
[ $rc -eq 0 ] && [ $prc -eq 0 ]

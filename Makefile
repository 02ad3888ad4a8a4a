# Two entry points: `make demo` and `make test`. Both set up .venv from pyproject.toml first.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench setup browser lint clean

setup: $(STAMP)

# torch is pinned to the local CPU wheel (torch==2.13.0) and installed first, so no
# resolver ever reaches for a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m posttrain.cli demo

test: $(STAMP) browser
	$(VPY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# Speed against Tunix, TRL and transformers + PyTorch in one run (benchmarks/bench.sh; ~30-42 min, never
# beside the tests: 2 cores). Rewrites the make-bench tables of docs/benchmarks.md and docs/bench_scaling.png.
bench: $(STAMP)
	ROUNDS=$(or $(ROUNDS),2) bash benchmarks/bench.sh

# tests/test_report.py opens the run report in a headless browser: Debian's chromium, installed when missing.
browser:
	@command -v chromium >/dev/null 2>&1 || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

lint: $(STAMP)
	$(VPY) -m ruff check posttrain tests benchmarks

clean:
	rm -rf $(VENV) runs

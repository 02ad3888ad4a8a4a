"""Test setup: 8 virtual CPU devices (for sharding tests), offline Hugging Face, shared fixtures."""

import os
import tempfile

# 8 virtual CPU devices, and LLVM at optimisation level 1 without its expensive passes: most test time
# is compiling (tests/test_dpo.py with the GRPO learning test, alone: 219 s -> 193 s at level 1, 197 s
# without the passes; the whole suite on an Intel AVX-512 machine that drifts: 22-24 min before, 19.4-22.6
# min after). Level 0 was faster still but moved the float round-off enough that
# the RL learning tests' SFT start began at 41.5 % instead of ~30 %.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=1 "
                                   "--xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# JAX's persistent compilation cache, shared by the xdist workers and every subprocess a test starts
# (the CLI kill/resume and multi-process tests compile the same programs again in each process): a
# folder of this test run only, so nothing carries over between runs. Compiled programs are keyed on
# the program, the flags and the JAX version; a cache hit is the same executable.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"posttrain-jax-cache-{os.environ.get('PYTEST_XDIST_TESTRUNUID') or os.getpid()}"))
# Every program, not only those that compile for over a second (JAX's default): the random initialisers
# compile once per parameter shape (0.4-2 s each) and the subprocess tests build the same models again.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import sys  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from hf_models import FAMILIES, make_checkpoint  # noqa: E402


@pytest.fixture
def x64():
    """float64 inside a test only (`pytestmark = pytest.mark.usefixtures("x64")`); the rest of the
    suite keeps JAX's float32 default."""
    import jax

    with jax.enable_x64(True):
        yield


def nested(d: dict, over: dict) -> dict:
    """`d` with dotted-key overrides applied in place ({"train.steps": 4} sets d["train"]["steps"])."""
    for k, v in over.items():
        node = d
        *path, leaf = k.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = v
    return d


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """family -> folder of a tiny random HF checkpoint (built once per test session)."""
    root = tmp_path_factory.mktemp("hf")
    return {fam: make_checkpoint(fam, root / fam) for fam in FAMILIES}


# The files that take longest, longest first. `make test` gives whole files to its two workers in this
# order (`--dist loadfile --no-loadscope-reorder`: a module's fixtures are built once), so the long ones
# start first and neither worker finishes minutes after the other. Order from `--durations=0`.
LONGEST_FIRST = ["test_faults.py", "test_rl_learning.py", "test_hybrid_learning.py",
                 "test_docs.py", "test_distill.py", "test_ppo.py",
                 "test_grpo.py", "test_cli.py", "test_gguf.py",
                 "test_dpo.py", "test_attention.py", "test_branches.py", "test_moe.py", "test_offpolicy.py",
                 "test_gpt_oss.py", "test_kto.py", "test_online_dpo.py", "test_agentic_rollout.py",
                 "test_gemma4.py", "test_multiprocess_sft.py", "test_sharding.py", "test_models.py",
                 "test_pipeline.py", "test_generate.py", "test_reward_model.py"]


# `make test-fast` (the edit loop) leaves these files out: -m "not slow". They train whole runs, start
# processes or compare real checkpoints; `make test` runs everything.
SLOW_FILES = set(LONGEST_FIRST) | {"test_multiprocess.py", "test_sharded_sft.py", "test_nonfinite.py",
                                   "test_agentic_env.py", "test_report.py", "test_gpu_bench.py",
                                   "test_routing_replay.py"}


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


def pytest_sessionfinish(session):
    """The run's compilation cache folder goes with the run (the xdist controller removes it)."""
    import shutil

    if not hasattr(session.config, "workerinput"):
        path = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
        if os.path.basename(path).startswith("posttrain-jax-cache-"):
            shutil.rmtree(path, ignore_errors=True)

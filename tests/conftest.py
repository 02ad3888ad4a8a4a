"""Test setup: 8 virtual CPU devices (for sharding tests), offline Hugging Face, shared fixtures."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

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

"""CPU defaults for XLA, applied when posttrain is imported before JAX starts.

YNNPACK fusions off (`--xla_cpu_experimental_ynn_fusion_type=`): measured on the 2-core CPU
machines +5-20 % training steps and +25-40 % decoding (docs/perf_notes.md). A value the
user already put in XLA_FLAGS wins; once a JAX backend has started (importing jax alone does
not start one), XLA_FLAGS is left alone.
"""

import os
import sys

_FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def _backends_started() -> bool:
    """XLA reads XLA_FLAGS when its first backend starts, not when `jax` is imported."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # private API moved: assume started, leave the flags alone
        return True


if not _backends_started() and _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=").strip()

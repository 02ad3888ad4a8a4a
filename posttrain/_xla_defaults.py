"""CPU defaults for XLA, applied when posttrain is imported before JAX starts.

YNNPACK fusions off (`--xla_cpu_experimental_ynn_fusion_type=`): measured on the 2-core CPU
machines +5-20 % training steps and +25-40 % decoding (../shared/PERF_NOTES.md). A value the
user already put in XLA_FLAGS wins; once JAX has started, XLA_FLAGS is left alone.
"""

import os
import sys

_FLAG = "--xla_cpu_experimental_ynn_fusion_type"

if "jax" not in sys.modules and _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=").strip()

"""CPU defaults for XLA, applied when posttrain is imported before JAX starts.

YNNPACK fusions off (`--xla_cpu_experimental_ynn_fusion_type=`): measured on the 2-core CPU
machines +5-20 % training steps and +25-40 % decoding (docs/perf_notes.md). A value the
user already put in XLA_FLAGS wins; once a JAX backend has started (importing jax alone does
not start one), XLA_FLAGS is left alone.

Opt-in, POSTTRAIN_KEEP_HEAP=1 (read at import, before a backend starts): glibc's malloc kept from unmapping XLA:CPU's
temporaries (`keep_heap`). An executable's temporaries are one block per call (368 MB for the tiny Qwen3-VL train step
of benchmarks/vlm.py), allocated from one of XLA's threads, which glibc serves from a fresh mmap and frees with munmap,
so each call faults in every page of it again (~90,000 page faults, ~150 ms of system time in a 1.2 s step at 1
thread). One malloc arena, no mmap and a 1 GiB trim threshold keep the freed block in the heap for the next call: that
step 1,172-1,186 -> 1,014-1,070 ms (docs/benchmarks.md, "Ninth stop"), bitwise the same results. Not the default:
glibc 2.36's memalign asks for the size plus the alignment plus a header, more than the freed block (as it seems), so
the heap grows by a few blocks before calls reuse it (a 64 MB temporary: 1-9 extra copies resident before the faults
stop; the VLM step: 0-700 MB more resident), freed memory stays resident, and every thread allocates from one arena.
"""

import os
import sys

_FLAG = "--xla_cpu_experimental_ynn_fusion_type"

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
TRIM_THRESHOLD = 1 << 30


def _backends_started() -> bool:
    """XLA reads XLA_FLAGS when its first backend starts, not when `jax` is imported."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # private API moved: assume started, leave the flags alone
        return True


def keep_heap() -> bool:
    """glibc only: one arena, no mmap, a 1 GiB trim threshold (see the module's docstring). True when applied. Only
    threads that have not allocated yet (XLA's start with its backend) take the one arena."""
    if sys.platform != "linux":
        return False
    import ctypes
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl's mallopt does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(k, v) == 1 for k, v in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))


if not _backends_started():
    if _FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=").strip()
    if os.environ.get("POSTTRAIN_KEEP_HEAP") == "1":
        keep_heap()

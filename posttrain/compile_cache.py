"""XLA's persistent compilation cache for posttrain's commands: a second run of the same shapes loads its
compiled programs from disk instead of compiling them again.

The CLI turns it on before any JAX computation (`enable()`); the library leaves JAX's configuration to the
caller. Where: `$POSTTRAIN_COMPILE_CACHE` if set (`off` turns the cache off), else
`$XDG_CACHE_HOME/posttrain/xla` (default `~/.cache/posttrain/xla`), in a sub-folder per jaxlib version and
host CPU (model name and instruction-set flags), so a cache on a shared home never offers one machine's code
to another. A `JAX_COMPILATION_CACHE_DIR` the user set wins. Programs that compiled in under 0.1 s are not
kept; the folder is capped at 2 GiB, least recently used entries evicted first (under a file lock, so
concurrent runs share it safely).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

ENV = "POSTTRAIN_COMPILE_CACHE"
MAX_BYTES = 2 << 30
MIN_COMPILE_SECS = 0.1


def _host_signature() -> str:
    """The CPU model name and flags of this host (an executable for one CPU may not run on another)."""
    seen = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in seen:
                    seen[key] = value.strip()
    except OSError:  # not Linux: the machine and processor names only
        import platform

        seen = {"machine": platform.machine(), "processor": platform.processor()}
    return hashlib.sha256(repr(sorted(seen.items())).encode()).hexdigest()[:12]


def cache_dir() -> Optional[Path]:
    """The folder `enable()` uses, or None when the cache is off."""
    value = os.environ.get(ENV, "")
    if value.lower() in ("off", "0", "false", "no"):
        return None
    if value:
        base = Path(value).expanduser()
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "posttrain" / "xla"
    import jaxlib

    return base / f"jaxlib-{jaxlib.__version__}-{_host_signature()}"


def enable() -> Optional[Path]:
    """Turn the cache on for this process (before its first compilation); returns the folder, or None when off
    or when the user configured JAX's own cache."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return None
    folder = cache_dir()
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home: run without the cache rather than fail
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return folder

"""Save and restore a (trainable) NNX state as one safetensors file, atomically.

Keys are the dotted parameter paths (`layers.0.attn.qkv_lora.a`). The file is written beside
its destination and renamed into place, so a crash mid-write never leaves a torn file.
What it is not: full training checkpoints with optimizer and data state ([ops] brings Orbax).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from posttrain.errors import PosttrainError
from posttrain.sharding import to_host


def _key(path) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def save_state(state: nnx.State, path: str) -> None:
    """Write `state` to `path`. In a multi-process run every process must call it (arrays that
    span processes are gathered, in the same order everywhere); only process 0 writes."""
    flat = {_key(p): to_host(v[...] if isinstance(v, nnx.Variable) else v) for p, v in nnx.to_flat_state(state)}
    if jax.process_index() != 0:
        return
    tmp = path + ".tmp"
    try:
        save_file(flat, tmp, metadata={"format": "posttrain"})
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: no torn file is left behind
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_state(path: str, like: nnx.State, arrays: dict | None = None) -> nnx.State:
    """Values from `path` placed into a copy of the structure `like` (shapes must match); `arrays`
    ({dotted key: array}, e.g. a checkpoint's parameters) instead of the file, `path` naming them."""
    data = arrays
    if data is None:
        if not os.path.isfile(path):
            raise PosttrainError(f"{path}: weights file is missing; was the run finished?")
        try:
            data = load_file(path)
        except (SafetensorError, OSError) as e:  # a torn or foreign file (header, sizes)
            raise PosttrainError(f"{path}: not a readable safetensors file ({e}); the file is corrupt or truncated, "
                                 "copy it again or train the run again") from None
    flat = []
    for p, v in nnx.to_flat_state(like):
        k = _key(p)
        if k not in data:
            raise PosttrainError(f"{path}: has no tensor {k!r}; the run's config.yaml does not match its weights")
        arr = data[k]
        if arr.shape != v.shape:
            raise PosttrainError(f"{path}: tensor {k!r} has shape {arr.shape}, the model expects {v.shape}")
        flat.append((p, v.replace(jnp.asarray(arr, v[...].dtype) if hasattr(v, "replace") else arr)))
    return nnx.from_flat_state(flat)

"""Training checkpoints with Orbax: atomic, asynchronous, keep-last-K, corrupt-latest fallback.

What it is: `Checkpointer(directory, keep=..., async_save=...)` saves, per step, the whole
`TrainState` (trainable params or LoRA adapters, the rest of the model state, optimizer state,
step, PRNG key) plus JSON items: the data iterator's state (exact resume: the next batch after
a restore is the one that would have come next) and free-form trainer metadata (RL bookkeeping
etc. later). Orbax writes each step into a temporary folder and renames it when complete, so a
crash mid-save never destroys the previous checkpoint; `restore_latest` tries the newest step
first and falls back to older ones, with a warning, when a checkpoint cannot be read. A save
that fails (a full disk, a file-size limit, a folder that cannot be written) raises a
`PosttrainError` that names the last good checkpoint, which stays as it was; the half-written
step is a temporary folder that Orbax never lists and removes when it next saves there.

What it is not: a model exporter (see `models.hf.save_pretrained`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from posttrain.errors import PosttrainError


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_saveable(tree):
    """Typed PRNG keys -> their raw uint32 data (what Orbax can store)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _from_saved(saved, like):
    return jax.tree.map(lambda s, ref: jax.random.wrap_key_data(s) if _is_key(ref) else s, saved, like)


def _abstract(tree):
    def one(x):
        x = jax.random.key_data(x) if _is_key(x) else x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data", "meta"))
        self.async_save = async_save
        self.saving: Optional[int] = None  # the step of the asynchronous save that may still be in flight
        self.failed = False

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, data_state: Optional[dict] = None, meta: Optional[dict] = None,
             force: bool = True) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(_to_saveable(state)),
                                  data=ocp.args.JsonSave(data_state or {}),
                                  meta=ocp.args.JsonSave(meta or {}))
        try:  # the save in flight (Orbax's save would wait for it too): its failure surfaces here
            self.manager.wait_until_finished()
        except Exception as e:  # whatever the storage said: that checkpoint is not on disk
            raise self._write_failed(e, self.saving) from e
        self.saving = None
        try:
            self.manager.save(step, args=args, force=force)
        except Exception as e:
            raise self._write_failed(e, step) from e
        self.saving = step if self.async_save else None

    def restore(self, step: int, like) -> tuple[Any, dict, dict]:
        """(state shaped like `like`, data state, meta) of `step`."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(like)), data=ocp.args.JsonRestore(),
                                  meta=ocp.args.JsonRestore())
        out = self.manager.restore(step, args=args)
        return _from_saved(out["state"], like), dict(out["data"] or {}), dict(out["meta"] or {})

    def restore_latest(self, like) -> Optional[tuple[int, Any, dict, dict]]:
        """The newest checkpoint that reads back, or None.

        Unreadable newer checkpoints are reported with a warning and deleted (training will write
        those steps again)."""
        found = None
        bad = []
        for step in reversed(self.steps()):
            try:
                state, data, meta = self.restore(step, like)
            except Exception as e:  # any unreadable file means this checkpoint is unusable
                warnings.warn(f"checkpoint step {step} in {self.directory} is unreadable ({type(e).__name__}: "
                              f"{str(e)[:200]}); falling back to an older checkpoint", stacklevel=2)
                bad.append(step)
                continue
            found = (step, state, data, meta)
            break
        for step in bad:
            self.manager.delete(step)
        return found

    def close(self) -> None:
        """Wait for the save in flight (raising if it failed, unless a failure was already raised)."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            if not self.failed:
                raise self._write_failed(e, self.saving) from e
        finally:
            try:
                self.manager.close()
            except Exception:
                if not self.failed:  # after a failed write, closing must not mask that failure
                    raise

    def _write_failed(self, err: Exception, step: Optional[int]) -> PosttrainError:
        self.failed = True
        self.saving = None
        # Orbax renames a step's temporary folder to its number only once it is complete
        names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
        good = sorted(int(d) for d in names if d.isdigit())
        kept = f"the last good checkpoint, step {good[-1]}, is kept" if good else "no earlier checkpoint exists"
        detail = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        return PosttrainError(f"could not write the checkpoint of step {step} in {self.directory} "
                              f"({type(err).__name__}: {detail}); {kept}; free disk space (or make the folder "
                              "writable) and run the same command again to resume")

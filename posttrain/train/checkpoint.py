"""Training checkpoints with Orbax: atomic, asynchronous, keep-last-K, corrupt-latest fallback.

What it is: `Checkpointer(directory, keep=..., async_save=...)` saves, per step, the whole
`TrainState` (trainable params or LoRA adapters, the rest of the model state, optimizer state,
step, PRNG key) plus JSON items: the data iterator's state (exact resume: the next batch after
a restore is the one that would have come next) and free-form trainer metadata (RL bookkeeping
etc. later). Orbax writes each step into a temporary folder and renames it when complete, so a
crash mid-save never destroys the previous checkpoint. `restore_latest` tries the newest step
first. A step whose files are unreadable, missing or truncated (corrupt: what a crash or a torn copy
leaves) is reported with a warning, moved aside to `<dir>/<step>.corrupt-<n>` (a rename: nothing is
deleted, and a later save of that step number finds the name free) and the step before is tried. A
step that reads fine but does not fit the state being built (another model, other shapes or dtypes:
compared with the checkpoint's stored metadata before any array is read) or that fails for any
other reason (out of memory, a permission or I/O error) stops with a `PosttrainError` naming the step,
the folder and the cause; every checkpoint is left in place. A save
that fails (a full disk, a file-size limit, a folder that cannot be written) raises a
`PosttrainError` that names the last good checkpoint, which stays as it was; the half-written
step is a temporary folder that Orbax never lists and removes when it next saves there.

What it is not: a model exporter (see `models.hf.save_pretrained`).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as cm

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


def _path(keys) -> tuple[str, ...]:
    """A key path as strings (dict keys, attribute names and list indices alike, as Orbax stores them)."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in keys)


# What a torn, truncated or half-deleted checkpoint raises (tensorstore status codes; JSON and
# Orbax's own messages). Anything else (RESOURCE_EXHAUSTED, PERMISSION_DENIED, an I/O error, ...)
# is not treated as corruption: the restore stops instead of skipping a checkpoint that may be fine.
_CORRUPT_CODES = ("NOT_FOUND:", "DATA_LOSS:", "OUT_OF_RANGE:")


def _is_corruption(err: BaseException) -> bool:
    if isinstance(err, (MemoryError, PermissionError)):
        return False
    if isinstance(err, (json.JSONDecodeError, FileNotFoundError, NotADirectoryError, EOFError)):
        return True
    text = str(err)
    if isinstance(err, KeyError) and "was not found in the checkpoint" in text:  # an item folder is gone
        return True
    return isinstance(err, ValueError) and any(code in text for code in _CORRUPT_CODES)


class _KeepStep(ocp.checkpoint_managers.PreservationPolicy):
    """Preserves the one checkpoint whose step `best()` names (the best evaluation so far)."""

    def __init__(self, best):
        self.best = best

    def should_preserve(self, checkpoints, *, context):
        return [info.step == self.best() for info in checkpoints]


class Checkpointer:
    """See the module docstring. With `best_metric`, a save whose meta holds {"best_metric": value}
    (an evaluation at that step) competes for the best step (`best_mode` "max" or "min"), which is
    kept beside the newest `keep` checkpoints; `best()` gives (step, value), read back on reopening."""

    def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True, best_metric: Optional[str] = None,
                 best_mode: str = "max"):
        self.directory = os.path.abspath(directory)
        self.best_metric, self.best_mode = best_metric, best_mode
        self._best: Optional[tuple[int, float]] = None
        policy = cm.LatestN(n=keep)
        if best_metric:
            policy = cm.AnyPreservationPolicy([policy, _KeepStep(lambda: self._best[0] if self._best else None)])
        options = ocp.CheckpointManagerOptions(preservation_policy=policy, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data", "meta"))
        self.async_save = async_save
        self.saving: Optional[int] = None  # the step of the asynchronous save that may still be in flight
        self.failed = False
        if best_metric:
            for step in self.steps():
                self._consider(step, self._meta(step).get("best_metric"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def best(self) -> Optional[tuple[int, float]]:
        """(step, value) of the best evaluated checkpoint so far, or None."""
        return self._best

    def improves(self, value: float) -> bool:
        """Whether an evaluation of `value` beats the best checkpoint so far (NaN never does)."""
        if value is None or value != value:
            return False
        if self._best is None:
            return True
        return value > self._best[1] if self.best_mode == "max" else value < self._best[1]

    def _consider(self, step: int, value) -> None:
        if value is not None and self.improves(float(value)):
            self._best = (step, float(value))

    def _meta(self, step: int) -> dict:
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            return dict(out["meta"] or {})
        except Exception:  # a corrupt step: restore_latest deals with it
            return {}

    def save(self, step: int, state, data_state: Optional[dict] = None, meta: Optional[dict] = None,
             force: bool = True) -> None:
        if self.best_metric and meta and "best_metric" in meta:
            self._consider(step, meta["best_metric"])  # before the save: its preservation keeps this step
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

    def restore_params(self, step: int) -> dict:
        """The trainable parameters saved at `step` as {dotted key: array} (no optimizer state is built)."""
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(restore_args=None))
        try:
            with warnings.catch_warnings():  # no target shardings: the saved ones, on this host's devices
                warnings.filterwarnings("ignore", message="Sharding info not provided")
                tree = self.manager.restore(step, args=args)["state"]
        except Exception as e:
            raise PosttrainError(f"could not read checkpoint step {step} in {self.directory} ({type(e).__name__}: "
                                 f"{str(e).strip()[:200]})") from e
        params = tree["params"] if isinstance(tree, dict) else tree.params
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        return {".".join(_path(p)).removesuffix(".value"): x for p, x in flat}

    def restore_latest(self, like) -> Optional[tuple[int, Any, dict, dict]]:
        """The newest checkpoint that reads back, or None.

        A corrupt newer checkpoint (unreadable, missing or truncated files) is reported with a warning
        and moved aside to `<step>.corrupt-<n>` (nothing is deleted); the one before is tried. Any other
        failure (the checkpoint does not fit `like`: another model, other shapes or dtypes; out of
        memory; a permission or I/O error) raises a PosttrainError naming the step, the folder and the
        cause, and leaves every checkpoint in place."""
        for step in reversed(self.steps()):
            try:
                stored = self._stored_shapes(step)
            except Exception as e:  # classified: corrupt -> fall back, else stop
                self._unreadable(step, e)
                continue
            self._check_fits(step, stored, like)
            try:
                state, data, meta = self.restore(step, like)
            except Exception as e:
                self._unreadable(step, e)
                continue
            return step, state, data, meta
        return None

    def _stored_shapes(self, step: int) -> dict[tuple, tuple]:
        """key path -> (shape, dtype) of every array of `step`'s train state, read from its metadata."""
        meta = ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory) / str(step) / "state")
        tree = getattr(meta, "tree", meta)
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {_path(p): (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)))
                for p, x in leaves}

    def _check_fits(self, step: int, stored: dict, like) -> None:
        """Raise unless the stored train state has `like`'s structure, shapes and dtypes."""
        want = {_path(p): (tuple(x.shape), str(x.dtype)) for p, x in jax.tree_util.tree_flatten_with_path(
            _abstract(like))[0]}
        missing, extra = sorted(want.keys() - stored.keys()), sorted(stored.keys() - want.keys())
        differ = [k for k in sorted(want.keys() & stored.keys()) if want[k] != stored[k]]
        if not (missing or extra or differ):
            return
        if differ:
            k = differ[0]
            more = f", and {len(differ) - 1} more differ" if len(differ) > 1 else ""
            cause = (f"{'.'.join(k)} is stored as {stored[k][1]}{list(stored[k][0])} but this run builds "
                     f"{want[k][1]}{list(want[k][0])}{more}")
        else:
            names = lambda ks: ", ".join(".".join(k) for k in ks[:3]) + (" ..." if len(ks) > 3 else "")  # noqa: E731
            cause = "; ".join(x for x in (f"missing from the checkpoint: {names(missing)}" if missing else "",
                                          f"not in this run's state: {names(extra)}" if extra else "") if x)
        folder = os.path.join(self.directory, str(step))
        raise PosttrainError(f"checkpoint step {step} ({folder}) does not fit the model being built: {cause}; it "
                             "was written by another model or config. Every checkpoint is kept: use a new run_dir, "
                             "or checkpoint.resume=false to start afresh")

    def _unreadable(self, step: int, err: Exception) -> None:
        """A corrupt step: warn and move it aside. Any other failure: raise, leaving everything in place."""
        folder = os.path.join(self.directory, str(step))
        detail = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
        if not _is_corruption(err):
            raise PosttrainError(f"could not restore checkpoint step {step} from {folder} ({detail}); no "
                                 "checkpoint was changed or removed; fix the cause (memory, permissions, "
                                 "storage) and run the same command again") from err
        aside = self._move_aside(step)
        warnings.warn(f"checkpoint step {step} in {self.directory} is unreadable ({detail}); moved it aside to "
                      f"{aside} (nothing deleted) and falling back to an older checkpoint", stacklevel=3)

    def _move_aside(self, step: int) -> str:
        """Rename `<dir>/<step>` to `<dir>/<step>.corrupt-<n>` (process 0; the others wait); its new path."""
        src = os.path.join(self.directory, str(step))
        n = 1
        while os.path.exists(f"{src}.corrupt-{n}"):
            n += 1
        dst = f"{src}.corrupt-{n}"
        if jax.process_index() == 0:
            os.rename(src, dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"posttrain:checkpoint {step} moved aside")
        self.manager.reload()  # forget the step: the training that follows writes it again
        return dst

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

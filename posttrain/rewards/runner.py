"""The reward runner: `score(funcs, weights, prompts, completions, columns)` runs each reward function
(`rewards/functions.py`'s protocol) once on the batch and returns the [N, F] reward matrix, a keep
mask and metrics. A function that raises, runs past `timeout_s`, returns the wrong number of values,
or returns a non-finite value or a non-number is counted in the metrics and handled per `on_error`
(zero, or drop the samples); it never ends the run. `combine` is TRL's weighted nansum of the rows.

What it is not: a sandbox (a reward function runs in this process with its rights).
References: TRL 1.16 `GRPOTrainer._calculate_rewards` (None -> NaN, metric names
`rewards/{name}/mean|std`, weighted nansum).
"""

from __future__ import annotations

import math
import numbers
import threading
import warnings
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from posttrain.errors import PosttrainError
from posttrain.rewards.functions import RewardFunc

# Threads of reward functions that ran past their timeout. Python cannot stop a thread, so they are
# left running as daemon threads (which do not hold up interpreter exit) and counted in the metrics.
_ABANDONED: list[threading.Thread] = []
_ABANDONED_LOCK = threading.Lock()


def reward_names(funcs: Sequence[RewardFunc]) -> list[str]:
    """Metric names of reward functions: a `name` attribute if it is a string, else `__name__`,
    else the type's name; repeats get `_2`, `_3`, ... (`[f, f]` -> `["f", "f_2"]`)."""
    names, used = [], set()
    for f in funcs:
        name = getattr(f, "name", None)
        if not isinstance(name, str) or not name:
            name = getattr(f, "__name__", None) or type(f).__name__
        base, k = name, 1
        while name in used:
            k += 1
            name = f"{base}_{k}"
        used.add(name)
        names.append(name)
    return names


def _call(f: RewardFunc, kwargs: dict, timeout_s: Optional[float], name: str) -> tuple[str, Any]:
    """("ok", result), ("error", exception) or ("timeout", None). With a timeout the function runs in a
    fresh daemon thread; a ThreadPoolExecutor is not used because its workers are joined at
    interpreter exit, so one hung reward function would hang the end of the run."""
    if timeout_s is None:
        try:
            return "ok", f(**kwargs)
        except Exception as e:
            return "error", e
    box: dict[str, Any] = {}

    def work():
        try:
            box["out"] = f(**kwargs)
        except BaseException as e:  # anything, SystemExit included, is this function's failure
            box["exc"] = e

    thread = threading.Thread(target=work, name=f"reward-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        with _ABANDONED_LOCK:
            _ABANDONED.append(thread)
        return "timeout", None
    if "exc" in box:
        return "error", box["exc"]
    if "out" not in box:
        return "error", RuntimeError("the worker thread ended without a result")
    return "ok", box["out"]


def _as_float(v: Any) -> Optional[float]:
    """float(v) for a real number (bool, int, float, NumPy scalar, 0-d array), else None."""
    if isinstance(v, numbers.Real):
        return float(v)
    if isinstance(v, (str, bytes)) or getattr(v, "ndim", 0) != 0 or not hasattr(v, "__float__"):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def combine(rewards: np.ndarray, weights: Optional[Sequence[float]] = None) -> np.ndarray:
    """The [N] total reward: sum over functions of weight * reward, NaN (None) entries skipped, and
    NaN where every function returned None (TRL's weighted nansum and unscorable rows)."""
    rewards = np.asarray(rewards, np.float64)
    w = np.ones(rewards.shape[1]) if weights is None else np.asarray(weights, np.float64)
    total = np.nansum(rewards * w[None, :], axis=1)
    total[np.isnan(rewards).all(axis=1)] = np.nan
    return total


def score(funcs: Sequence[RewardFunc], weights: Optional[Sequence[float]], prompts: Sequence,
          completions: Sequence, columns: Optional[Mapping[str, Sequence]] = None, *,
          timeout_s: Optional[float] = None, on_error: str = "zero") -> tuple[np.ndarray, np.ndarray, dict]:
    """Score a batch of N samples with F reward functions.

    Each function is called once, `f(prompts=..., completions=..., **columns)`, on its own shallow
    copies of the lists, in order. Returns `(rewards, keep, stats)`:
    - rewards: [N, F] float64, unweighted, NaN where a function returned None (or, with "drop",
      where its value was lost); `combine(rewards, weights)` gives the totals.
    - keep: [N] bool, False for samples dropped by `on_error="drop"`.
    - stats, for each function name (see `reward_names`): `rewards/<name>/mean` and `/std` (NumPy
      mean and Bessel-corrected std, as TRL's nanstd, over the valid numbers the function returned:
      no None, failures or substitutes; NaN when there are none / fewer than 2), `/errors` (calls that
      raised or returned something that is not N values), `/timeouts` (calls that ran past
      `timeout_s`), `/nonfinite` (samples whose value was NaN, +-inf or not a real number); and
      `reward` (the mean of the weighted total over kept, scorable samples), `rewards/dropped`
      (samples with keep False), `rewards/abandoned_threads` (timed-out calls still running).
    Failures, per `on_error`: "zero" sets the function's reward to 0.0 for the affected samples
    (the whole batch for a raise, timeout or wrong result; the one sample for a bad value); "drop"
    sets keep False for them. Each failure also warns once per distinct message.
    `timeout_s=None` runs the functions in the calling thread (no timeout). With a timeout each call
    runs in a daemon thread; one that overruns is abandoned, still running (Python cannot kill a
    thread), and the next call gets a fresh thread, so it never blocks the run.
    Errors in the arguments themselves (lengths, names, on_error) raise PosttrainError."""
    if on_error not in ("zero", "drop"):
        raise PosttrainError(f"reward on_error must be 'zero' or 'drop', got {on_error!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise PosttrainError(f"reward timeout_s must be > 0 seconds or None, got {timeout_s}")
    funcs = list(funcs)
    for f in funcs:
        if not callable(f):
            raise PosttrainError(f"reward function {f!r} is not callable")
    n, nf = len(prompts), len(funcs)
    if len(completions) != n:
        raise PosttrainError(f"rewards: {n} prompts but {len(completions)} completions")
    columns = dict(columns or {})
    for key, col in columns.items():
        if key in ("prompts", "completions"):
            raise PosttrainError(f"rewards: a column may not be named {key!r} (it is a reward function argument)")
        if len(col) != n:
            raise PosttrainError(f"rewards: column {key!r} has {len(col)} values for {n} samples")
    w = np.ones(nf) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    if w.shape != (nf,) or not np.isfinite(w).all():
        raise PosttrainError(f"rewards: need {nf} finite weights (one per reward function), got {weights!r}")

    names = reward_names(funcs)
    rewards = np.full((n, nf), np.nan)
    keep = np.ones(n, bool)
    stats: dict[str, float] = {}
    for j, (f, name) in enumerate(zip(funcs, names)):
        kwargs = {"prompts": list(prompts), "completions": list(completions),
                  **{k: list(v) for k, v in columns.items()}}
        status, out = _call(f, kwargs, timeout_s, name)
        counts = {"errors": 0, "timeouts": 0, "nonfinite": 0}
        values = np.full(n, np.nan)
        bad = np.zeros(n, bool)
        whole_batch = status != "ok"
        if status == "timeout":
            counts["timeouts"] = 1
            warnings.warn(f"reward function {name!r} ran past timeout_s={timeout_s}; its rewards count as failed "
                          f"({on_error}) and its thread is left running", RuntimeWarning, stacklevel=2)
        elif status == "error":
            counts["errors"] = 1
            warnings.warn(f"reward function {name!r} raised {type(out).__name__}: {out}; its rewards count as "
                          f"failed ({on_error})", RuntimeWarning, stacklevel=2)
        elif isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__") or len(out) != n:
            counts["errors"], whole_batch = 1, True
            got = f"{len(out)} values" if hasattr(out, "__len__") else type(out).__name__
            warnings.warn(f"reward function {name!r} returned {got} for {n} samples; its rewards count as failed "
                          f"({on_error})", RuntimeWarning, stacklevel=2)
        else:
            for i, v in enumerate(out):
                if v is None:
                    continue
                x = _as_float(v)
                if x is None or not math.isfinite(x):
                    bad[i] = True
                else:
                    values[i] = x
            counts["nonfinite"] = int(bad.sum())
            if counts["nonfinite"]:
                first = out[int(np.argmax(bad))]
                warnings.warn(f"reward function {name!r} returned {counts['nonfinite']} values that are not finite "
                              f"numbers (first: {first!r}); they count as failed ({on_error})", RuntimeWarning,
                              stacklevel=2)
        valid = values[~np.isnan(values)]
        stats[f"rewards/{name}/mean"] = float(valid.mean()) if valid.size else math.nan
        stats[f"rewards/{name}/std"] = float(valid.std(ddof=1)) if valid.size > 1 else math.nan
        for kind, c in counts.items():
            stats[f"rewards/{name}/{kind}"] = float(c)
        failed = np.ones(n, bool) if whole_batch else bad
        if on_error == "zero":
            values[failed] = 0.0
        else:
            keep &= ~failed
        rewards[:, j] = values

    total = combine(rewards, w)[keep]
    total = total[~np.isnan(total)]
    stats["reward"] = float(total.mean()) if total.size else math.nan
    stats["rewards/dropped"] = float((~keep).sum())
    with _ABANDONED_LOCK:
        _ABANDONED[:] = [t for t in _ABANDONED if t.is_alive()]
        stats["rewards/abandoned_threads"] = float(len(_ABANDONED))
    return rewards, keep, stats

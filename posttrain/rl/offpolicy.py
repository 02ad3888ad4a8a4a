"""Off-policy rollouts: a producer that samples up to `max_staleness` batches ahead of the trainer.

What it is: `StaleRollout(inner, max_staleness)` wraps a `GroupRollout` as the trainer's batch source. The
batch of step r (0-based) is sampled from the weights after max(0, r - Δ) updates (Δ = max_staleness): a
fixed pipeline, so what a step trains on never depends on timing, and every batch is tagged with the
policy version that sampled it (`rollout/version_lag` = r - version, <= Δ by construction; a batch older
than Δ would be dropped and counted in `rollout/dropped_stale`, which this schedule never needs).
After the trainer takes batch r, the producer samples batch r + Δ from a copy of the current weights (the
train step donates its own buffers) in a background thread, so on an accelerator sampling overlaps the
update; `overlap=False` samples in the caller's thread (the same batches). The old log-probs of a batch
are its sampler's, so the loss's ratio pi_theta / pi_old is the importance weight of the stale sample (as
TRL's async GRPO and verl's one-step-off do). Δ = 0 is not wrapped at all (the on-policy trainer as it is).

Checkpoints: `get_state()` waits for the producer and saves the prompt stream's position with the batches
sampled ahead (their weights are gone), so a resumed run trains on exactly the batches the uninterrupted
one would have.

What it is not: a separate sampler mesh (the producer samples on the sampler's devices, whatever they are)
or a server.
"""

from __future__ import annotations

import base64
import io
import threading
from collections import deque
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.train.step import TrainState


def _pack(batch: dict) -> str:
    buf = io.BytesIO()
    np.savez(buf, **batch)
    return base64.b64encode(buf.getvalue()).decode()


def _unpack(text: str) -> dict:
    with np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


class StaleRollout:
    def __init__(self, inner, max_staleness: int, *, overlap: bool = True):
        if max_staleness < 1:
            raise ValueError("StaleRollout needs max_staleness >= 1 (0 is the plain on-policy rollout)")
        if inner.mu != 1:
            raise ValueError("off-policy rollouts need num_iterations = 1")
        self.inner, self.delta, self.overlap = inner, max_staleness, overlap
        self.calls = 0  # batches handed to the trainer
        self.queue: deque = deque()  # (rollout index, version, batch, its statistics) sampled ahead, in order
        self.worker: Optional[threading.Thread] = None
        self.failed: Optional[BaseException] = None
        self.taken: list[dict] = []  # statistics of the batches handed out since the last metrics()
        self.lags: list[int] = []
        self.dropped = 0

    @property
    def sampler(self):
        return self.inner.sampler

    def _produce(self, state, index: int, version: int) -> None:
        try:
            batch = self.inner.rollout(state, index)
            self.queue.append((index, version, batch, self.inner.metrics()))  # the producer's thread only
        except BaseException as e:  # re-raised in the trainer's thread
            self.failed = e

    def _wait(self) -> None:
        if self.worker is not None:
            self.worker.join()
            self.worker = None
        if self.failed is not None:
            err, self.failed = self.failed, None
            raise err

    def __call__(self, state) -> dict:
        r = self.calls
        self._wait()
        if not self.queue:  # the start: batches 0 .. Δ all come from the first weights
            for i in range(r, r + self.delta + 1):
                self._produce(state, i, r)
                self._wait()
        index, version, batch, stats = self.queue.popleft()
        while r - version > self.delta:  # older than the limit (not produced by this schedule): dropped
            self.dropped += 1
            self._produce(state, r, r)
            self._wait()
            index, version, batch, stats = self.queue.popleft()
        self.lags.append(r - version)
        self.taken.append(stats)
        self.calls += 1
        ahead = r + self.delta  # the batch this state's weights sample
        if not self.queue or self.queue[-1][0] < ahead:
            snapshot = TrainState(step=state.step, params=jax.tree.map(jnp.copy, state.params),
                                  rest=jax.tree.map(jnp.copy, state.rest), opt_state=None, rng=state.rng,
                                  nonfinite=state.nonfinite)
            if self.overlap:
                self.worker = threading.Thread(target=self._produce, args=(snapshot, ahead, r), daemon=True,
                                               name="posttrain-rollout")
                self.worker.start()
            else:
                self._produce(snapshot, ahead, r)
        return batch

    def get_state(self) -> dict:
        self._wait()
        return {"inner": self.inner.get_state(), "calls": self.calls,
                "queue": [[i, v, _pack(b), m] for i, v, b, m in self.queue]}

    def set_state(self, st: dict) -> None:
        self._wait()
        self.inner.set_state(st["inner"])
        self.calls = st["calls"]
        self.queue = deque((i, v, _unpack(b), m) for i, v, b, m in st["queue"])

    def metrics(self) -> dict:
        """The rollout statistics of the batches trained on since the last call (each logged with the step that
        consumed it, not the one during which it was sampled), their version lags, the stale batches dropped."""
        keys = {k for m in self.taken for k in m}
        out = {k: float(np.mean([m[k] for m in self.taken if k in m])) for k in sorted(keys)}
        self.taken = []
        if self.lags:
            out["rollout/version_lag"] = float(np.mean(self.lags))
            out["rollout/version_lag_max"] = float(max(self.lags))
        out["rollout/dropped_stale"] = float(self.dropped)
        self.lags = []
        return out

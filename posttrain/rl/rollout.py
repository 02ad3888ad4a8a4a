"""GRPO rollouts: prompts -> n samples each from the train state's own weights -> rewards -> advantages -> rows.

What it is: `GroupRollout(...)` is the batch source of the GRPO trainer (`train.loop` calls it
with the current TrainState before every step):
  1. the next `batch_size` prompts (a Grain-shuffled stream over the prompt set, checkpointable);
  2. `n` samples each from the `Sampler`, which runs on the state's own parameter buffers
     (`Sampler.update(merged_state(state))`: no copy and, shapes being equal, no recompile);
     each prompt is prefilled once and its cache shared by its n samples; the PRNG key of
     rollout r is fold_in(key(seed), r), so a resumed run samples exactly what it would have;
  3. rewards from the reward functions (`rewards/runner.score`: failures counted, never fatal;
     dropped samples leave the loss), weighted and turned into advantages by the estimator named `advantages`
     (`losses.advantages.ESTIMATORS`: group = GRPO, rloo, reinforce_pp);
     DAPO dynamic sampling optionally replaces groups whose rewards do not vary (no signal) with
     groups of further prompts, a bounded number of tries;
  4. one prefix-shared row per prompt (`data.branches.group_row`: the prompt once, its n
     completions as branches in [n, max_new] score slots) with the sampler's log-probs as the
     "old" log-probs, so no extra forward is needed when μ = 1.
With `vision` (a Qwen3-VL model's VisionConfig) prompts with images (`Prompt.pixels`) are sampled with them and
their rows carry M-RoPE positions and the images' patch tables (`rl/images.py`).
The rollout is reused for `num_iterations` (μ) steps; a rollout still in use is saved in the
checkpoint, so a killed run resumes to the same weights as an uninterrupted one.
`metrics()` returns the host-side statistics since the last call (reward mean/std per function,
completion length, truncation rate, reward failures, generate / reward seconds).

What it is not: the loss (`losses/grpo.py`) or the trainer (`trainers/grpo.py`).
"""

from __future__ import annotations

import base64
import functools
import io
import time
import warnings
from collections import defaultdict
from typing import Callable, Optional, Sequence

import grain
import jax
import numpy as np

from posttrain.data.branches import ROW_FIELDS, SCORE_FIELDS, group_row
from posttrain.data.images import patch_bucket
from posttrain.data.prompts import Prompt
from posttrain.generate import Sampler, SamplingParams
from posttrain.losses.advantages import estimate_advantages
from posttrain.rewards.runner import score as score_rewards
from posttrain.rl.images import add_image_fields, sampler_images
from posttrain.train.step import merged_state


class GroupRollout:
    def __init__(self, prompts: list[Prompt], tok, sampler: Sampler, graphdef, *, batch_size: int, n: int,
                 params: SamplingParams, reward_funcs: Sequence[Callable], reward_weights: Sequence[float],
                 length: int, seed: int = 0, shuffle: bool = True, num_iterations: int = 1, scale: str = "group",
                 advantages: str = "group", reward_timeout_s: Optional[float] = None, on_reward_error: str = "zero",
                 dynamic_sampling: bool = False, max_refills: int = 3, vision=None):
        self.prompts, self.tok, self.sampler, self.graphdef = prompts, tok, sampler, graphdef
        self.batch_size, self.n, self.params, self.length = batch_size, n, params, length
        self.funcs, self.weights = list(reward_funcs), np.asarray(reward_weights, np.float64)
        self.seed, self.mu, self.scale, self.advantages = seed, num_iterations, scale, advantages
        self.timeout, self.on_error = reward_timeout_s, on_reward_error
        self.dynamic, self.max_refills = dynamic_sampling, max_refills
        self.vision = vision if vision is not None and any(p.pixels is not None for p in prompts) else None
        self.patches = patch_bucket(prompts, vision) if self.vision is not None else 0
        ds = grain.MapDataset.range(len(prompts))
        if shuffle:
            ds = ds.shuffle(seed=seed)
        self._stream = iter(ds.repeat(None).to_iter_dataset(grain.ReadOptions(num_threads=0)))
        self.calls = 0  # steps served; rollout r serves steps r*μ .. r*μ + μ - 1
        self.cached: Optional[dict] = None
        self._stats: dict = defaultdict(list)

    # ------------------------------------------------------------------ the batch source protocol

    def __call__(self, state) -> dict:
        if self.calls % self.mu == 0 or self.cached is None:
            self.cached = self.rollout(state, self.calls // self.mu)
        self.calls += 1
        return self.cached

    def get_state(self) -> dict:
        out = {"prompts": self._stream.get_state(), "calls": self.calls}
        if self.cached is not None and self.calls % self.mu:  # a rollout still in use
            buf = io.BytesIO()
            np.savez(buf, **self.cached)
            out["cached"] = base64.b64encode(buf.getvalue()).decode()
        return out

    def set_state(self, st: dict) -> None:
        self._stream.set_state(st["prompts"])
        self.calls = st["calls"]
        self.cached = None
        if "cached" in st:
            with np.load(io.BytesIO(base64.b64decode(st["cached"])), allow_pickle=False) as f:
                self.cached = {k: f[k] for k in f.files}

    def metrics(self) -> dict:
        """Means of the rollout statistics gathered since the last call (a producer thread may be adding more:
        the gathered ones are swapped out first)."""
        stats, self._stats = self._stats, defaultdict(list)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a statistic that was NaN in every rollout
            return {k: float(np.nanmean(np.asarray(v, np.float64))) for k, v in stats.items() if v}

    # ------------------------------------------------------------------ one rollout

    def _sample(self, key, count: int):
        group = [self.prompts[next(self._stream)] for _ in range(count)]
        t0 = time.perf_counter()
        images = sampler_images(group) if self.vision is not None else None
        out = self.sampler.generate([p.ids for p in group], self.params, key=key,
                                    **({} if images is None else {"images": images}))
        t1 = time.perf_counter()
        n = self.n
        texts = out.texts(self.tok)
        prompts = [p.prompt for p in group for _ in range(n)]
        columns = {}
        for k in {k for p in group for k in p.columns}:
            columns[k] = [p.columns.get(k) for p in group for _ in range(n)]
        columns["completion_ids"] = [t[:m].tolist() for t, m in zip(out.tokens, out.lengths)]  # as TRL passes
        rewards, keep, stats = score_rewards(self.funcs, self.weights, prompts, texts, columns,
                                             timeout_s=self.timeout, on_error=self.on_error)
        self._stats["time/generate_s"].append(t1 - t0)
        self._stats["time/reward_s"].append(time.perf_counter() - t1)
        for k, v in stats.items():
            self._stats[k].append(v)
        rewards = np.where(keep[:, None], rewards, np.nan)
        total = np.nansum(rewards * self.weights, axis=1)
        total = np.where(keep & ~np.all(np.isnan(rewards), axis=1), total, np.nan).reshape(count, n)
        return group, out, rewards, keep, total

    def rollout(self, state, r: int) -> dict:
        self.sampler.update(merged_state(state))
        key = jax.random.fold_in(jax.random.key(self.seed), r)
        group, out, rewards, keep, total = self._sample(jax.random.fold_in(key, 0), self.batch_size)
        if self.dynamic:  # DAPO: groups whose rewards all agree carry no signal; swap in new ones
            signal = lambda g: np.isfinite(g).sum() > 1 and np.nanstd(g) > 0  # noqa: E731
            good = [i for i in range(self.batch_size) if signal(total[i])]
            tries = 0
            while len(good) < self.batch_size and tries < self.max_refills:
                tries += 1
                more = self._sample(jax.random.fold_in(key, tries), self.batch_size)
                take = [i for i in range(self.batch_size) if signal(more[4][i])][:self.batch_size - len(good)]
                group, out, rewards, keep, total = _replace(self.n, (group, out, rewards, keep, total), more,
                                                            [i for i in range(self.batch_size) if i not in good],
                                                            take)
                good = [i for i in range(self.batch_size) if signal(total[i])]
            self._stats["dynamic_sampling/refills"].append(tries)
            self._stats["dynamic_sampling/no_signal_groups"].append(self.batch_size - len(good))
        adv = _advantages(self.advantages, total.reshape(-1, 1), self.n, self.scale, out.lengths)
        adv = np.nan_to_num(np.asarray(adv, np.float64)).reshape(self.batch_size, self.n)
        finite = np.isfinite(total)
        self._stats["reward/mean"].append(float(np.nanmean(total)) if finite.any() else float("nan"))
        self._stats["reward/std"].append(float(np.nanstd(total)) if finite.any() else float("nan"))
        self._stats["completion/length"].append(float(out.lengths.mean()))
        self._stats["completion/truncated"].append(float(np.mean([f == "length" for f in out.finish_reasons])))
        return self.rows(group, out, adv, keep)

    def rows(self, group: list[Prompt], out, adv: np.ndarray, keep: np.ndarray) -> dict:
        n, T = self.n, self.params.max_new_tokens
        B = len(group)
        batch = {f: np.zeros((B, self.length), np.int32) for f in ROW_FIELDS}
        batch["tokens"][:] = self.sampler.pad_id
        batch.update({f: np.zeros((B, n * T), np.float32 if f == "score_w" else np.int32) for f in SCORE_FIELDS})
        batch["old_logps"] = np.zeros((B, n * T), np.float32)
        batch["advantages"] = adv.astype(np.float32)
        for i, p in enumerate(group):
            rows = range(i * n, (i + 1) * n)
            conts = [out.tokens[r, :out.lengths[r]] for r in rows]
            row = group_row(p.ids, conts, T)
            L = len(row["tokens"])
            for f in ROW_FIELDS:
                batch[f][i, :L] = row[f]
            for f in SCORE_FIELDS:
                batch[f][i] = row[f]
            batch["old_logps"][i] = np.concatenate([out.logprobs[r] for r in rows])
            w = batch["score_w"][i].reshape(n, T)
            w[~keep[list(rows)]] = 0.0  # dropped samples (reward failures with on_error="drop") leave the loss
        batch["old_logps"] *= batch["score_w"] != 0
        if out.routes is not None:  # routing replay: the experts each row token was routed to by the sampler
            batch["routes"] = group_routes(group, out, n, self.length)
        if self.vision is not None:  # image prompts: M-RoPE positions, the prompts' patch tables
            add_image_fields(batch, group, self.vision, self.patches)
        # another precision than the trainer's (or a KV cache stored in one): not the old policy's log-probs
        if self.sampler.dtype is not None or getattr(self.sampler, "kv_dtype", None) is not None:
            batch["sampler_logps"] = batch.pop("old_logps")
        return batch


_UNTRACEABLE: set = set()  # estimators a jit failed to trace: op by op from then on


@functools.lru_cache(maxsize=None)
def _jitted_estimator(name: str, n: int, scale: str):
    return jax.jit(lambda r, lengths: estimate_advantages(name, r, None, n, scale=scale, lengths=lengths))


def _advantages(name: str, total: np.ndarray, n: int, scale: str, lengths) -> np.ndarray:
    """`estimate_advantages` of the rollout's [N, 1] weighted rewards. On a CPU op by op, as written (the CPU
    parity and learning tests' round-off); on an accelerator as one jitted program: op by op there, each of its
    ~30 ops is a dispatch to the chip (host time in GRPO's step, #56). An estimator a jit cannot trace (Python
    control flow on values: a user's registered one) runs op by op there too."""
    if jax.default_backend() != "cpu" and (name, n, scale) not in _UNTRACEABLE:
        try:
            return np.asarray(_jitted_estimator(name, n, scale)(total, lengths))
        except jax.errors.ConcretizationTypeError:
            _UNTRACEABLE.add((name, n, scale))  # not traced again at every rollout
    return np.asarray(estimate_advantages(name, total, None, n, scale=scale, lengths=lengths))


def group_routes(group: list[Prompt], out, n: int, length: int) -> np.ndarray:
    """[B, length, M, k] experts of each group row's tokens (`data.branches.group_row`'s layout: the prompt,
    then its n completions one after another), from the sampler's record (-1: a token's own routing)."""
    M, k = out.routes.shape[2:]
    routes = np.full((len(group), length, M, k), -1, np.int32)
    for i, p in enumerate(group):
        P = len(p.ids)
        routes[i, :P] = out.prompt_routes[i, :P]
        slot = P
        for r in range(i * n, (i + 1) * n):
            L = int(out.lengths[r])
            routes[i, slot:slot + L] = out.routes[r, :L]
            slot += L
    return routes


def _replace(n, cur, new, slots, take):
    """`cur` with groups `slots[:len(take)]` replaced by `new`'s groups `take`."""
    group, out, rewards, keep, total = cur
    ngroup, nout, nrewards, nkeep, ntotal = new
    group, rewards, keep, total = list(group), rewards.copy(), keep.copy(), total.copy()
    tokens, logprobs, lengths = out.tokens.copy(), out.logprobs.copy(), out.lengths.copy()
    reasons = list(out.finish_reasons)
    routes = None if out.routes is None else (out.routes.copy(), out.prompt_routes.copy())
    for dst, src in zip(slots, take):
        group[dst] = ngroup[src]
        total[dst] = ntotal[src]
        d, s = slice(dst * n, dst * n + n), slice(src * n, src * n + n)
        rewards[d], keep[d] = nrewards[s], nkeep[s]
        tokens[d], logprobs[d], lengths[d] = nout.tokens[s], nout.logprobs[s], nout.lengths[s]
        reasons[d] = nout.finish_reasons[s]
        if routes is not None:
            routes[0][d], routes[1][dst] = nout.routes[s], nout.prompt_routes[src]
    out = type(out)(tokens, logprobs, lengths, reasons, out.prompt_index, *(routes or ()))
    return group, out, rewards, keep, total

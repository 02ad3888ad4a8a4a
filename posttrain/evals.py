"""Evaluation of a model's sampled answers: pass@k, maj@k, mean reward and length, with intervals.

What it is:
  - `pass_at_k(num_samples, num_correct, k)`: the unbiased pass@k estimator of Chen et al. 2021
    (1 - C(n-c, k) / C(n, k)), element-wise over arrays;
  - `maj_at_k(keys, correct)`: majority voting over each prompt's samples (see its doc for ties);
  - `bootstrap_interval(values)`: the 95 % percentile bootstrap interval of a mean over prompts;
  - `summarize(correct, rewards, lengths, keys)`: every metric of one evaluation with its interval;
  - `SampledEval`: k samples per prompt from the compiled sampler, scored by reward functions; one
    instance serves `posttrain eval` and the in-loop evaluation of every trainer (`eval.k`);
  - `accuracy(model, tok, pairs)`: greedy exact-match accuracy of (prompt, answer) string pairs.
A sample is correct when its total reward (the weighted sum of the reward functions, as in
training) is at least `correct_at` (1.0: a right answer under math_answer / last_number).

What it is not: a loss evaluation (`train.trainer.make_eval`) or a benchmark harness with its own
prompt formats (the prompts are rows of a data file, as a trainer reads them).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np

from posttrain.generate import Sampler, SamplingParams
from posttrain.rewards.functions import answer_key
from posttrain.rewards.runner import score
from posttrain.tokenizer import Tokenizer


def pass_at_k(num_samples, num_correct, k: int):
    """P(at least one of k samples drawn without replacement from n is correct), given c of the n are:
    1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i) (Chen et al. 2021, stable
    in float64). Broadcasts over arrays (a float for scalars); needs 1 <= k <= n."""
    n, c = np.broadcast_arrays(np.asarray(num_samples, np.int64), np.asarray(num_correct, np.int64))
    if k < 1 or (n < k).any() or (c < 0).any() or (c > n).any():
        raise ValueError(f"pass_at_k needs 1 <= k <= num_samples and 0 <= num_correct <= num_samples (k={k})")
    out = np.ones(n.shape, np.float64)
    flat_n, flat_c, flat = n.ravel(), c.ravel(), out.ravel()
    for j, (nj, cj) in enumerate(zip(flat_n, flat_c)):
        if nj - cj >= k:  # else every draw of k holds a correct one
            flat[j] = 1.0 - np.prod(1.0 - k / np.arange(nj - cj + 1, nj + 1, dtype=np.float64))
    return float(out) if out.ndim == 0 else out


def maj_at_k(keys: Sequence[Sequence[Optional[str]]], correct) -> np.ndarray:
    """[N] majority-vote score of each prompt's samples: the answer most samples give (`keys`: each
    sample's answer key, None = no answer, which does not vote) is scored by the correctness of the
    samples that gave it (`correct` [N, k]). Ties are shared: when several answers have the most votes
    the score is the fraction of them that are correct (the expected score of a uniformly random
    tie-break). A prompt where no sample has an answer scores 0."""
    correct = np.asarray(correct, bool)
    out = np.zeros(len(keys), np.float64)
    for i, row in enumerate(keys):
        votes: dict[str, list[int]] = {}
        for j, key in enumerate(row):
            if key is not None:
                votes.setdefault(key, []).append(j)
        if not votes:
            continue
        top = max(map(len, votes.values()))
        winners = [js for js in votes.values() if len(js) == top]
        out[i] = np.mean([correct[i, js[0]] for js in winners])
    return out


def bootstrap_interval(values, *, level: float = 0.95, resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of mean(values) (values: one number per prompt): the prompts are
    resampled with replacement `resamples` times; NaN values (unscorable prompts) are left out."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, len(v), (resamples, len(v)))
    means = v[idx].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def summarize(correct, rewards, lengths, keys, *, k: Optional[int] = None, seed: int = 0) -> dict:
    """{metric: (value, (lo, hi))} of one evaluation of N prompts x n samples: pass@1, pass@k, maj@k
    (over all n samples), reward (the mean total reward, NaN samples left out) and length (mean tokens)."""
    correct = np.asarray(correct, bool)
    n = correct.shape[1]
    k = n if k is None else k
    per_prompt = {"pass@1": pass_at_k(n, correct.sum(1), 1), f"pass@{k}": pass_at_k(n, correct.sum(1), k),
                  f"maj@{n}": maj_at_k(keys, correct)}
    with np.errstate(all="ignore"):
        r = np.asarray(rewards, np.float64)
        per_prompt["reward"] = np.where(np.isfinite(r).any(1), np.nansum(r, 1) / np.isfinite(r).sum(1), np.nan)
    per_prompt["length"] = np.asarray(lengths, np.float64).mean(1)
    out = {}
    for name, v in per_prompt.items():
        v = np.atleast_1d(v)
        finite = v[np.isfinite(v)]
        out[name] = (float(finite.mean()) if len(finite) else float("nan"), bootstrap_interval(v, seed=seed))
    return out


class SampledEval:
    """k samples per prompt (one prefill per prompt, `prompts_per_call` prompts per sampler call) from a
    model's weights, scored by `reward_funcs`; `run(model)` -> (summary, seconds). The sampler compiles
    once; later calls with new weights of the same model (`run(state_model)`) reuse it. The sampling key
    is the same every call (seed), so evaluations at different steps differ only by the weights."""

    def __init__(self, prompts: list, tok: Tokenizer, reward_funcs: Sequence, reward_weights: Sequence[float], *,
                 k: int, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 correct_at: float = 1.0, seed: int = 0, prompts_per_call: int = 64,
                 reward_timeout_s: Optional[float] = None, mesh=None, rules=None):
        self.prompts, self.tok, self.k, self.correct_at, self.seed = prompts, tok, k, correct_at, seed
        self.funcs, self.weights = list(reward_funcs), np.asarray(reward_weights, np.float64)
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                     top_k=top_k, n=k, stop_ids=tok.eos_ids)
        self.per_call, self.timeout, self.mesh, self.rules = prompts_per_call, reward_timeout_s, mesh, rules
        self.sampler: Optional[Sampler] = None

    def run(self, model) -> tuple[dict, float]:
        import jax

        t0 = time.perf_counter()
        if self.sampler is None:
            longest = max(len(p.ids) for p in self.prompts)
            self.sampler = Sampler(model, max_len=longest + self.params.max_new_tokens, pad_id=self.tok.pad_id,
                                   mesh=self.mesh, rules=self.rules)
        else:
            self.sampler.update(model)
        k, texts, lengths = self.k, [], []
        for c, i in enumerate(range(0, len(self.prompts), self.per_call)):
            chunk = self.prompts[i:i + self.per_call]
            if len(chunk) < self.per_call and i:  # one compiled shape: pad the last call with repeats
                chunk = chunk + [chunk[0]] * (self.per_call - len(chunk))
            out = self.sampler.generate([p.ids for p in chunk], self.params,
                                        key=jax.random.fold_in(jax.random.key(self.seed), c))
            take = min(self.per_call, len(self.prompts) - i) * k
            texts += out.texts(self.tok)[:take]
            lengths += out.lengths[:take].tolist()
        columns = {name: [p.columns.get(name) for p in self.prompts for _ in range(k)]
                   for name in {c for p in self.prompts for c in p.columns}}
        rewards, keep, _ = score(self.funcs, self.weights, [p.prompt for p in self.prompts for _ in range(k)], texts,
                                 columns, timeout_s=self.timeout)
        with np.errstate(all="ignore"):
            total = np.nansum(rewards * self.weights, axis=1)
        total = np.where(keep & ~np.isnan(rewards).all(axis=1), total, np.nan).reshape(-1, k)
        correct = np.nan_to_num(total, nan=-np.inf) >= self.correct_at
        keys = [[answer_key(t) for t in texts[i * k:(i + 1) * k]] for i in range(len(self.prompts))]
        summary = summarize(correct, total, np.asarray(lengths).reshape(-1, k), keys, seed=self.seed)
        return summary, time.perf_counter() - t0

    def metrics(self, model, prefix: str = "eval_") -> dict:
        """The metrics of `run(model)` as flat numbers for the metric sinks ({prefix}pass@1, ...)."""
        summary, seconds = self.run(model)
        return {**{f"{prefix}{name}": value for name, (value, _) in summary.items()}, f"{prefix}seconds": seconds}


def format_table(summary: dict) -> str:
    """A summary (`summarize`) as a text table: metric | value | 95 % interval."""
    lines = [f"{'metric':<10} | {'value':>9} | 95 % interval", "-" * 42]
    for name, (value, (lo, hi)) in summary.items():
        lines.append(f"{name:<10} | {value:>9.4f} | [{lo:.4f}, {hi:.4f}]")
    return "\n".join(lines)


def accuracy(model, tok: Tokenizer, pairs, max_new_tokens: int = 8) -> float:
    """Greedy exact-match accuracy of completions for (prompt, answer) string pairs."""
    prompts = [tok.encode(p) for p, _ in pairs]
    sampler = Sampler(model, max_len=max(len(p) for p in prompts) + max_new_tokens + 16)
    out = sampler.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                   stop_ids=tok.eos_ids))
    texts = out.texts(tok)
    return float(np.mean([t.strip() == a for t, (_, a) in zip(texts, pairs)]))

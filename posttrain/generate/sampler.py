"""Batched generation over a Transformer: jitted prefill, then a jitted `lax.while_loop` decode (in phases).

What it is: the sampler for `posttrain generate` and for RL rollouts. It runs the trainer's own
model code, so its log-probabilities equal the trainer's on the same tokens.
What it is not: a server or a continuous-batching engine.

How it is fast (../shared/PERF_NOTES.md): prompts are left-padded to a length bucket, so calls
whose prompts share a bucket reuse one compiled prefill and decode; `n` samples of a prompt
share one prefill (its cache is repeated n times on device); the decode loop, sampling
included, is a `lax.while_loop` that exits early once every row has stopped; the cache is
[B, K, S, H], starts at the prompt bucket and grows in a few phases (one while_loop each), so
attention reads about the filled slots only; RoPE tables are computed once per call.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.errors import PosttrainError
from posttrain.generate.sampling import SamplingParams, select
from posttrain.models.transformer import KVCache, Transformer
from posttrain.sharding import use_mesh


@dataclasses.dataclass
class Completions:
    """Generated rows; prompt i's samples are rows i*n .. i*n + n - 1."""

    tokens: np.ndarray  # [R, max_new_tokens] int32, pad after each row's end
    logprobs: np.ndarray  # [R, max_new_tokens] float32, 0 after each row's end
    lengths: np.ndarray  # [R] tokens generated (a stop token counts)
    finish_reasons: list  # "stop" | "length" per row
    prompt_index: np.ndarray  # [R] which prompt each row continues

    def texts(self, tokenizer) -> list[str]:
        return [tokenizer.decode(t[:n].tolist()) for t, n in zip(self.tokens, self.lengths)]


def phase_sizes(prompt: int, max_new: int) -> list[int]:
    """Cache sizes of the decode phases: up to 4 equal steps from `prompt` to `prompt + max_new - 1`.

    Decode attention costs the cache size (measured linear on CPU), so a cache that grows in
    phases saves about a quarter of it; each phase is one more compiled loop body, hence few
    phases, and one for short generations.
    """
    need = max_new - 1  # slots the decode steps write after the prompt
    phases = 1 if need < 64 else min(4, need // 32)
    step = -(-need // phases)
    return [prompt + min(need, step * (j + 1)) for j in range(phases)]


def grow(cache: KVCache, size: int) -> KVCache:
    """The cache padded with empty slots (pos -1) to `size` slots."""
    extra = size - cache.size
    if extra <= 0:
        return cache

    def pad(x, value=0, axis=2):  # a concatenate: measured ~30 % faster than jnp.pad on CPU
        fill = jnp.full(x.shape[:axis] + (extra,) + x.shape[axis + 1:], value, x.dtype)
        return jnp.concatenate([x, fill], axis=axis)

    return dataclasses.replace(cache, k=tuple(map(pad, cache.k)), v=tuple(map(pad, cache.v)),
                               pos=pad(cache.pos, -1, axis=1),
                               branch=None if cache.branch is None else pad(cache.branch, 0, axis=1))


def default_buckets(max_len: int) -> tuple[int, ...]:
    b, out = 16, []
    while b < max_len:
        out.append(b)
        b *= 2
    return tuple(out) + (max_len,)


class Sampler:
    def __init__(self, model: Transformer, *, max_len: Optional[int] = None,
                 buckets: Optional[Sequence[int]] = None, pad_id: int = 0, mesh=None, rules=None):
        """max_len: the longest prompt + new tokens a call may ask for (the cache size bound).

        mesh / rules: run under a device mesh (the model's logical sharding constraints apply)."""
        self.mesh, self.rules = mesh, rules
        self.cfg = model.cfg
        self.graphdef, self.state = nnx.split(model)
        self.max_len = int(max_len or min(self.cfg.max_position, 4096))
        self.buckets = tuple(sorted(buckets)) if buckets else default_buckets(self.max_len)
        self.pad_id = pad_id
        self.traces = collections.Counter()  # compilations (trace count) per function
        self.prefill_rows = 0  # prompt rows prefilled so far (n samples share one)
        self._prefill = jax.jit(self._prefill_fn)
        self._decode = jax.jit(self._decode_fn, static_argnames=("params", "max_new"))

    def update(self, model_or_state) -> None:
        """Use new weights (e.g. after a training step); shapes are unchanged, nothing recompiles."""
        self.state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state

    # --------------------------------------------------------------------------------- jitted parts

    def _prefill_fn(self, state, tokens, positions, segments):
        with use_mesh(self.mesh, self.rules):
            return self._prefill_body(state, tokens, positions, segments)

    def _prefill_body(self, state, tokens, positions, segments):
        """The prompts' next-token logits and a cache of exactly the prompt bucket (decode grows it)."""
        self.traces["prefill"] += 1
        model = nnx.merge(self.graphdef, state)
        cache = KVCache.init(self.cfg, tokens.shape[0], tokens.shape[1])
        out = model(tokens, positions, cache=cache, segment_ids=segments, return_hidden=True, return_logits=False)
        return model.unembed(out.hidden[-1][:, -1:])[:, 0], out.cache

    def _decode_fn(self, state, logits, cache, next_pos, key, stop, max_new_row, *, params, max_new):
        """logits [B,V] of each prompt's next token; returns tokens, logprobs, lengths [B*n, ...]."""
        with use_mesh(self.mesh, self.rules):
            return self._decode_body(state, logits, cache, next_pos, key, stop, max_new_row, params, max_new)

    def _decode_body(self, state, logits, cache, next_pos, key, stop, max_new_row, params, max_new):
        self.traces["decode"] += 1
        model = nnx.merge(self.graphdef, state)
        n = params.n
        if n > 1:  # share each prompt's prefill across its n samples
            rep = functools.partial(jnp.repeat, repeats=n, axis=0)
            cache = dataclasses.replace(cache, k=tuple(map(rep, cache.k)), v=tuple(map(rep, cache.v)),
                                        pos=rep(cache.pos), branch=None if cache.branch is None else rep(cache.branch))
            logits, next_pos = rep(logits), rep(next_pos)
        R, P = logits.shape[0], cache.size
        ropes = model.rope_tables(P + max_new)  # every position is < prompt bucket + max_new

        def is_stop(tok):
            return jnp.any(tok[:, None] == stop, axis=-1)

        tok, lp = select(logits, jax.random.fold_in(key, 0), params)
        out_tok = jnp.full((R, max_new), self.pad_id, jnp.int32).at[:, 0].set(tok)
        out_lp = jnp.zeros((R, max_new), jnp.float32).at[:, 0].set(lp)
        done = is_stop(tok) | (max_new_row <= 1)
        carry = (jnp.int32(1), tok, next_pos, cache, done, out_tok, out_lp, jnp.ones((R,), jnp.int32))

        def body(c):
            i, tok, pos, cache, done, out_tok, out_lp, lengths = c
            out = model(tok[:, None], pos[:, None], cache=cache, return_hidden=True, return_logits=False,
                        rope_tables=ropes)
            logits = model.unembed(out.hidden[-1])[:, 0]
            new, lp = select(logits, jax.random.fold_in(key, i), params)
            new = jnp.where(done, self.pad_id, new)
            lp = jnp.where(done, 0.0, lp)
            out_tok = jax.lax.dynamic_update_slice(out_tok, new[:, None], (0, i))
            out_lp = jax.lax.dynamic_update_slice(out_lp, lp[:, None], (0, i))
            lengths = lengths + (~done).astype(jnp.int32)
            done = done | is_stop(new) | (i + 1 >= max_new_row)
            return i + 1, new, pos + 1, out.cache, done, out_tok, out_lp, lengths

        # Step i writes cache slot P + i - 1. The cache grows in phases, so attention (which reads
        # every slot of the cache) reads about the filled part only: one while_loop per phase.
        for size in phase_sizes(P, max_new):
            carry = carry[:3] + (grow(carry[3], size),) + carry[4:]
            last = size - P + 1  # steps this phase's cache can hold

            def cond(c, last=last):
                return (c[0] < min(max_new, last)) & ~jnp.all(c[4])

            carry = jax.lax.while_loop(cond, body, carry)
        return carry[5], carry[6], carry[7]  # tokens, logprobs, lengths

    # --------------------------------------------------------------------------------- public

    def bucket(self, length: int) -> int:
        for b in self.buckets:
            if b >= length:
                return b
        raise PosttrainError(f"prompt of {length} tokens is longer than the sampler allows ({self.buckets[-1]}); "
                             "shorten it or build the Sampler with a larger max_len")

    def generate(self, prompts: Sequence[Sequence[int]], params: Optional[SamplingParams] = None, *,
                 key: Optional[jax.Array] = None, stop_ids: Optional[Sequence[Sequence[int]]] = None,
                 max_new_tokens: Optional[Sequence[int]] = None) -> Completions:
        """Continue each prompt (token ids). stop_ids / max_new_tokens optionally differ per prompt."""
        params = SamplingParams() if params is None else params
        if not prompts:
            raise PosttrainError("generate: no prompts given")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise PosttrainError(f"generate: prompt {i} is empty; give at least one token (e.g. BOS)")
        B, M = len(prompts), params.max_new_tokens
        longest = max(len(p) for p in prompts)
        if longest + M > self.max_len:
            raise PosttrainError(
                f"generate: prompt of {longest} tokens + max_new_tokens {M} exceeds the cache limit "
                f"max_len={self.max_len}; shorten the prompt, lower max_new_tokens or raise max_len")
        P = self.bucket(longest)
        toks = np.full((B, P), self.pad_id, np.int32)
        segs = np.zeros((B, P), np.int32)
        pos = np.zeros((B, P), np.int32)
        for i, p in enumerate(prompts):
            toks[i, P - len(p):] = p
            segs[i, P - len(p):] = 1
            pos[i, P - len(p):] = np.arange(len(p))
        lens = np.array([len(p) for p in prompts], np.int32)
        row_stops = [tuple(params.stop_ids)] * B if stop_ids is None else [tuple(s) for s in stop_ids]
        width = max(1, max(len(s) for s in row_stops))
        stop = np.full((B, width), -1, np.int32)
        for i, s in enumerate(row_stops):
            stop[i, :len(s)] = s
        row_max = np.full((B,), M, np.int32) if max_new_tokens is None else np.asarray(max_new_tokens, np.int32)
        if (row_max <= 0).any() or (row_max > M).any():
            raise PosttrainError(f"generate: per-row max_new_tokens must be in [1, {M}]")
        n = params.n
        stops = np.repeat(stop, n, 0)  # per sample row
        key = jax.random.key(0) if key is None else key
        logits, cache = self._prefill(self.state, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(segs))
        self.prefill_rows += B
        out_tok, out_lp, lengths = self._decode(
            self.state, logits, cache, jnp.asarray(lens), key, jnp.asarray(stops),
            jnp.asarray(np.repeat(row_max, n)), params=params, max_new=M)
        out_tok, out_lp, lengths = jax.device_get((out_tok, out_lp, lengths))
        last = out_tok[np.arange(len(lengths)), lengths - 1]
        reasons = ["stop" if (s == t).any() else "length" for s, t in zip(stops, last)]
        return Completions(np.asarray(out_tok), np.asarray(out_lp), np.asarray(lengths), reasons,
                           np.repeat(np.arange(B), n))

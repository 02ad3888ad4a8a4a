"""Batched generation over a Transformer: jitted prefill, then a jitted `lax.while_loop` decode (in phases).

What it is: the sampler for `posttrain generate` and for RL rollouts. It runs the trainer's own
model code, so its log-probabilities equal the trainer's on the same tokens.
What it is not: a server or a continuous-batching engine.

How it is fast (docs/perf_notes.md): prompts are left-padded to a length bucket, so calls
whose prompts share a bucket reuse one compiled prefill and decode; `n` samples of a prompt
share one prefill (its cache is repeated n times on device); the decode loop, sampling
included, is a `lax.while_loop` that exits early once every row has stopped; the cache is
[B, K, S, H], starts at the prompt bucket and grows in a few phases (one while_loop each), so
attention reads about the filled slots only; RoPE tables are computed once per program. `generate` compiles a new
shape's prefill and each decode phase as programs of their own, in parallel threads (generate/programs.py).
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
from posttrain.generate.programs import Programs
from posttrain.generate.sampling import SamplingParams, kv_cache_dtype, select
from posttrain.generate.shapes import (  # noqa: F401 (re-exported)
    BLOCK_STEP,
    SLOT_STEP,
    default_buckets,
    grow,
    is_stop,
    phase_sizes,
    push,
    repeat_rows,
    round_up,
    stop_sequence_array,
)
from posttrain.models import scan
from posttrain.models.moe import chosen_experts
from posttrain.models.transformer import KVCache, Transformer, with_compute_dtype
from posttrain.sharding import use_mesh


@dataclasses.dataclass
class Completions:
    """Generated rows; prompt i's samples are rows i*n .. i*n + n - 1."""

    tokens: np.ndarray  # [R, max_new_tokens] int32, pad after each row's end
    logprobs: np.ndarray  # [R, max_new_tokens] float32, 0 after each row's end
    lengths: np.ndarray  # [R] tokens generated (a stop token counts)
    finish_reasons: list  # "stop" | "length" per row
    prompt_index: np.ndarray  # [R] which prompt each row continues
    # with SamplingParams.record_routes (an MoE model): the experts [.., M MoE layers, k] each token was routed to
    # when it was fed to the model: routes [R, max_new_tokens, M, k] of the sampled tokens (-1 for a token never
    # fed: a row's last, and the padding), prompt_routes [B, P, M, k] of prompt i's P tokens (its first len_i)
    routes: Optional[np.ndarray] = None
    prompt_routes: Optional[np.ndarray] = None

    def texts(self, tokenizer) -> list[str]:
        return [tokenizer.decode(t[:n].tolist()) for t, n in zip(self.tokens, self.lengths)]


@dataclasses.dataclass
class Turn:
    """Multi-turn sampling between two turns (`Sampler.begin` / `Sampler.extend`): every row's KV
    cache, kept on device, and per row what the next `extend` needs. Row r here is row r of the
    Completions returned with it."""

    cache: KVCache  # [R', K, S, H] with R' >= rows (padding rows after the real ones)
    index: int  # cache.index on the host: the next slot a block or a decode step writes
    lengths: np.ndarray  # [rows] tokens of each row's sequence so far (prompt + sampled + appended)
    last: np.ndarray  # [rows] each row's last sampled token (not in the cache: fed with the next block)
    max_rows: int  # rows of the first turn (a later turn's batch is a power of two up to this)

    @property
    def rows(self) -> int:
        return len(self.lengths)


class Sampler:
    # generate: compile a new shape's prefill and decode phases as separate programs, concurrently (programs.py);
    # False: one prefill and one decode program, as begin/extend and image prompts do; None: True but on a CPU
    concurrent_compile: Optional[bool] = None
    # XLA build options for the prefill program of that concurrent compile, e.g. {"exec_time_optimization_effort":
    # -1.0}; None: XLA's defaults (after the quick first prefill below, if on)
    prefill_compile_options: Optional[dict] = None
    # True: the concurrent compile's first call of a shape runs its prefill compiled at XLA's lowest effort
    # (programs.QUICK_PREFILL; TPU v5e, llama3-1b, 64 x 128 prompt tokens: the first call 20.5-21.6 -> 17.6-18.4 s),
    # the second call compiles the default prefill and runs it, as every later call does (programs.Upgrade). The quick
    # program runs without XLA's prefetching (0.124 -> 0.298 s there) and its logits are not bitwise the default's,
    # so a first call can differ from a later call on the same inputs at bfloat16 rounding. `posttrain generate`
    # (one call) turns it on; False elsewhere (the trainers' rollouts resume bitwise)
    quick_first_prefill: bool = False

    def __init__(self, model: Transformer, *, max_len: Optional[int] = None,
                 buckets: Optional[Sequence[int]] = None, pad_id: int = 0, mesh=None, rules=None,
                 dtype: Optional[str] = None, own_mesh: bool = False, kv_dtype: Optional[str] = None):
        """max_len: the longest prompt + new tokens a call may ask for (the cache size bound).

        mesh / rules: run under a device mesh (the model's logical sharding constraints apply).
        dtype: sample in this precision (e.g. "bfloat16" over float32 training weights): the weights are
        cast on every `update` (a copy in that dtype), activations and the KV cache are in it; its
        log-probs then differ from the trainer's (see `losses.sampler_correction`). None: the model's own.
        own_mesh: `mesh` is the sampler's own devices, not the model's: the weights are copied there
        (replicated, device to device) now and on every `update`.
        kv_dtype: the KV cache's storage dtype (sampling.KV_DTYPES, e.g. "float8_e4m3fn": half a bfloat16 cache's
        bytes, so a decode step reads less); None: the compute dtype. Not the trainer's log-probs then either."""
        self.mesh, self.rules = mesh, rules
        self.dtype = None if dtype is None or jnp.dtype(dtype) == jnp.dtype(model.cfg.dtype) else jnp.dtype(dtype)
        if self.dtype is not None:
            model = with_compute_dtype(model, self.dtype.name)
            self._cast = jax.jit(lambda st: jax.tree.map(
                lambda x: x.astype(self.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, st))
        self.own_mesh = own_mesh and mesh is not None
        kv = kv_cache_dtype(kv_dtype, "Sampler kv_dtype")
        self.kv_dtype = None if kv is None or kv == jnp.dtype(model.cfg.dtype) else kv  # None: the compute dtype
        self.cfg = model.cfg
        # identical layers run as one lax.scan (models/scan.py): the cache is then [L, B, K, S, H] and each call
        # stacks the weights once (`layer_stack`), not every decode step
        self._scan = scan.applies(model)
        self.graphdef, state = nnx.split(model)
        # On CPU, XLA's dot against a tied embedding [V, D] read transposed runs at half the speed of a
        # [D, V] operand (measured: 11.2 vs 5.8 ms for SmolLM2's 49k x 576 head at 8 rows): the sampler keeps
        # the head transposed once per `update` (one V x D copy) and every decode step reads that.
        self._head_t = (jax.jit(lambda st: nnx.merge(self.graphdef, st).embed[...].T)
                        if model.lm_head is None and jax.default_backend() == "cpu" else None)
        self.state = self._prepare(state)
        self.max_len = int(max_len or min(self.cfg.max_position, 4096))
        self.buckets = tuple(sorted(buckets)) if buckets else default_buckets(self.max_len)
        self.pad_id = pad_id
        self.traces = collections.Counter()  # compilations (trace count) per function
        self.prefill_rows = 0  # prompt rows prefilled so far (n samples share one)
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("record",))
        self._decode = jax.jit(self._decode_fn, static_argnames=("params", "max_new"))
        self._turn = jax.jit(self._turn_fn, static_argnames=("params", "max_new", "phases"))
        self._keep = jax.jit(self._keep_fn, static_argnames=("size",))
        self._programs = Programs(self)  # generate's prefill and decode phases, compiled concurrently
        self._images = None  # generate/vision.py's ImagePrefill, made at the first call with images
        self.vision = getattr(model, "vcfg", None) or self.cfg.vision  # a vision-language model's vision config

    def update(self, model_or_state) -> None:
        """Use new weights (e.g. after a training step); shapes are unchanged, nothing recompiles."""
        state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
        self.state = self._prepare(state)

    @property
    def state(self):
        return self._state

    @state.setter
    def state(self, state):
        self._state = state
        self._weights = (state, None if self._head_t is None else self._head_t(state))

    def _merge(self, weights):
        """(the model, its unembedding [D, V] or None) from the jitted functions' weights argument."""
        state, head = weights
        return nnx.merge(self.graphdef, state), head

    def _prepare(self, state):
        """The weights as this sampler runs them: on its own mesh (replicated), in its dtype."""
        if self.own_mesh:
            from jax.sharding import NamedSharding, PartitionSpec

            state = jax.device_put(state, NamedSharding(self.mesh, PartitionSpec()))
        return self._cast(state) if self.dtype is not None else state

    # --------------------------------------------------------------------------------- jitted parts

    def _prefill_fn(self, state, tokens, positions, segments, record=False, extras=None):
        with use_mesh(self.mesh, self.rules):
            return self._prefill_body(state, tokens, positions, segments, record, extras)

    def _prefill_body(self, state, tokens, positions, segments, record=False, extras=None):
        """The prompts' next-token logits and a cache of exactly the prompt bucket (decode grows it); with
        `record` also the experts of every prompt token ([B, P, M, k]); extras: image rows' forward keywords
        (generate/vision.py's ImagePrefill: embeds and deepstack with positions [3, B, P], or embeds and image_ids)."""
        self.traces["prefill"] += 1
        model, head = self._merge(state)
        cache = KVCache.init(self.cfg, tokens.shape[0], tokens.shape[1], stacked=self._scan, kv_dtype=self.kv_dtype)
        out = model(tokens, positions, cache=cache, segment_ids=segments, return_hidden=True,
                    return_logits=False, return_router_logits=record, **(extras or {}))
        logits = model.unembed(out.hidden[-1][:, -1:], head)[:, 0]
        if record:
            return logits, out.cache, chosen_experts(out.router_logits, self.cfg.experts_per_token)
        return logits, out.cache

    def _decode_fn(self, state, logits, cache, next_pos, key, stop, max_new_row, *, params, max_new):
        """logits [B,V] of each prompt's next token; returns tokens, logprobs, lengths [B*n, ...] (, routes). One
        program (`generate` compiles these steps as several: generate/programs.py)."""
        with use_mesh(self.mesh, self.rules):
            self.traces["decode"] += 1
            model, head = self._merge(state)
            logits, cache, next_pos = repeat_rows(logits, cache, next_pos, params.n)
            out = self._decode_loop(model, logits, cache, next_pos, key, stop, max_new_row, params, max_new,
                                    head=head)
            return out[:3] + out[4:]  # tokens, logprobs, lengths (, routes)

    def _decode_loop(self, model, logits, cache, next_pos, key, stop, max_new_row, params, max_new, seqs=None,
                     phases=True, head=None):
        """The decode while_loops from next-token logits [R, V] over `cache` (written from `cache.index`).

        seqs [Q, L] int32 (or None): stop sequences, right-aligned, -1 = any token; a row also stops
        when its last L sampled tokens match one. phases: grow the cache in phases by max_new - 1 slots
        (else it must already hold them: one loop). Returns (tokens, logprobs, lengths, cache, routes)."""
        P, start = cache.size, cache.index  # start: the slot decode step 1 writes (P after a prefill)
        stack = scan.stack(model) if self._scan else None  # the weights stacked once for every step (scan.py)
        ropes = model.rope_tables(P + max_new)  # once for every phase
        carry = self._decode_init(logits, cache, next_pos, key, stop, max_new_row, params, max_new, seqs)
        # Step i writes cache slot start + i - 1. The cache grows in phases, so attention (which reads
        # every slot of the cache) reads about the filled part only: one while_loop per phase. One new token
        # (max_new 1) is the prefill's: no decode step is traced or compiled.
        for size in (phase_sizes(P, max_new) if phases else (P,)) if max_new > 1 else ():
            carry = carry[:3] + (grow(carry[3], size),) + carry[4:]
            carry = self._decode_phase(model, head, stack, carry, start, size, P, key, stop, max_new_row, params,
                                       max_new, seqs, ropes)
        return carry[5], carry[6], carry[7], carry[3], carry[9]  # tokens, logprobs, lengths, cache, routes

    def _decode_init(self, logits, cache, next_pos, key, stop, max_new_row, params, max_new, seqs):
        """The first sampled token (from the prefill's logits) and the decode loops' carry."""
        R = logits.shape[0]
        tok, lp = select(logits, jax.random.fold_in(key, 0), params)
        hist = None if seqs is None else push(jnp.full((R, seqs.shape[1]), -1, jnp.int32), tok)
        out_tok = jnp.full((R, max_new), self.pad_id, jnp.int32).at[:, 0].set(tok)
        out_lp = jnp.zeros((R, max_new), jnp.float32).at[:, 0].set(lp)
        done = is_stop(tok, hist, stop, seqs) | (max_new_row <= 1)
        moe_layers = sum(self.cfg.is_moe_layer(i) for i in range(self.cfg.num_layers))
        routes = (jnp.full((R, max_new, moe_layers, self.cfg.experts_per_token), -1, jnp.int32)
                  if params.record_routes else None)
        return jnp.int32(1), tok, next_pos, cache, done, out_tok, out_lp, jnp.ones((R,), jnp.int32), hist, routes

    def _decode_phase(self, model, head, stack, carry, start, size, P, key, stop, max_new_row, params, max_new,
                      seqs, ropes=None):
        """One phase's while_loop of decode steps over the carry's cache of `size` slots (P: the prompt bucket);
        ropes: the RoPE tables of positions < P + max_new (None: computed here, a program of one phase)."""
        ropes = model.rope_tables(P + max_new) if ropes is None else ropes  # every position is < P + max_new
        record = params.record_routes

        def body(c):
            i, tok, pos, cache, done, out_tok, out_lp, lengths, hist, routes = c
            # A row that stopped keeps feeding padding; a Gated DeltaNet state cannot take a token back (the
            # attention slots are emptied after the loop), so there the fed token counts only while not done.
            live = (~done)[:, None].astype(jnp.int32) if cache.linear else None
            out = model(tok[:, None], pos[:, None], cache=cache, segment_ids=live, return_hidden=True,
                        return_logits=False, rope_tables=ropes, return_router_logits=record, layer_stack=stack)
            if record:  # the token sampled at step i - 1, fed now: its experts (a stopped row's stay -1)
                chosen = chosen_experts(out.router_logits, self.cfg.experts_per_token)[:, 0]
                old = jax.lax.dynamic_index_in_dim(routes, i - 1, axis=1, keepdims=False)
                chosen = jnp.where(done[:, None, None], old, chosen)
                routes = jax.lax.dynamic_update_index_in_dim(routes, chosen, i - 1, axis=1)
            logits = model.unembed(out.hidden[-1], head)[:, 0]
            new, lp = select(logits, jax.random.fold_in(key, i), params)
            new = jnp.where(done, self.pad_id, new)
            lp = jnp.where(done, 0.0, lp)
            out_tok = jax.lax.dynamic_update_slice(out_tok, new[:, None], (0, i))
            out_lp = jax.lax.dynamic_update_slice(out_lp, lp[:, None], (0, i))
            lengths = lengths + (~done).astype(jnp.int32)
            hist = push(hist, new)
            done = done | is_stop(new, hist, stop, seqs) | (i + 1 >= max_new_row)
            return i + 1, new, pos + 1, out.cache, done, out_tok, out_lp, lengths, hist, routes

        last = size - start + 1  # steps this phase's cache can hold

        def cond(c):
            return (c[0] < jnp.minimum(max_new, last)) & ~jnp.all(c[4])

        return jax.lax.while_loop(cond, body, carry)

    def _keep_fn(self, cache, rows, *, size):
        """Rows `rows` of the cache, grown to `size` slots: the rows that go on to the next turn, with room
        for it."""
        take = functools.partial(jnp.take, indices=rows, axis=0)
        cache = dataclasses.replace(cache.map_kv(lambda x, a: jnp.take(x, rows, axis=a)), pos=take(cache.pos),
                                    branch=None if cache.branch is None else take(cache.branch),
                                    linear=jax.tree.map(take, cache.linear))
        return grow(cache, size)

    def _turn_fn(self, state, cache, head, key, stop, max_new_row, seqs, *, params, max_new, phases):
        """One turn of multi-turn sampling on a cache whose rows are the turn's rows (`_keep`): prefill the
        appended block at its positions onto the cache (or, the first turn, take the prefill's logits of
        rows head["rows"]), then decode; the slots each row wrote at and after its last sampled token are
        emptied (a stopped row keeps feeding padding until the loop ends)."""
        with use_mesh(self.mesh, self.rules):
            self.traces["turn"] += 1
            model, head_t = self._merge(state)
            if "tokens" in head:
                out = model(head["tokens"], head["positions"], cache=cache, segment_ids=head["segments"],
                            return_hidden=True, return_logits=False)
                logits, cache = model.unembed(out.hidden[-1][:, -1:], head_t)[:, 0], out.cache
                next_pos = head["positions"][:, -1] + 1  # blocks are left-padded: the last slot is real
            else:
                logits, next_pos = jnp.take(head["logits"], head["rows"], 0), jnp.take(head["next_pos"], head["rows"])
            start = cache.index
            tokens, logps, lengths, cache, _ = self._decode_loop(model, logits, cache, next_pos, key, stop, max_new_row,
                                                              params, max_new, seqs, phases, head_t)
            slot = jnp.arange(cache.size, dtype=jnp.int32)
            cache = dataclasses.replace(cache, pos=jnp.where(slot[None] >= start + lengths[:, None] - 1, -1, cache.pos))
            return tokens, logps, lengths, cache

    # --------------------------------------------------------------------------------- public

    def bucket(self, length: int) -> int:
        for b in self.buckets:
            if b >= length:
                return b
        raise PosttrainError(f"prompt of {length} tokens is longer than the sampler allows ({self.buckets[-1]}); "
                             "shorten it or build the Sampler with a larger max_len")

    def generate(self, prompts: Sequence[Sequence[int]], params: Optional[SamplingParams] = None, *,
                 key: Optional[jax.Array] = None, stop_ids: Optional[Sequence[Sequence[int]]] = None,
                 max_new_tokens: Optional[Sequence[int]] = None, images=None) -> Completions:
        """Continue each prompt (token ids). stop_ids / max_new_tokens optionally differ per prompt.
        images (a vision-language model: Qwen3-VL, Gemma3VL): one `generate.vision.ImageInputs` (or None) per
        prompt, for its image tokens (each image's full run, e.g. `expand_image_tokens`)."""
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
        record = params.record_routes
        if record and not self.cfg.num_experts:
            raise PosttrainError("generate: record_routes needs a mixture-of-experts model (this one has no router)")
        next_pos, extras = lens, {}
        if images is not None and any(im is not None for im in images):  # else the text path, unchanged
            if self._images is None:
                from posttrain.generate.vision import ImagePrefill

                self._images = ImagePrefill(self)
            pos, delta, keywords = self._images(toks, segs, images)
            next_pos, extras = lens + delta, {"extras": keywords}  # decode: text position + delta (M-RoPE)
        args = (self._weights, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(segs))
        rest = (jnp.asarray(next_pos), key, jnp.asarray(stops), jnp.asarray(np.repeat(row_max, n)))
        if self.mesh is None and not extras and self._programs.applies(self.concurrent_compile, self._weights):
            pre, out = self._programs.run(*args, *rest, params, M, record)
        else:
            pre = self._prefill(*args, record=record, **extras)
            out = self._decode(self._weights, *pre[:2], *rest, params=params, max_new=M)
        self.prefill_rows += B
        out_tok, out_lp, lengths = (np.asarray(x) for x in jax.device_get(out[:3]))
        last = out_tok[np.arange(len(lengths)), lengths - 1]
        reasons = ["stop" if (s == t).any() else "length" for s, t in zip(stops, last)]
        routes = prompt_routes = None
        if record:  # prompt routes left-aligned: prompt i's token j at j
            routes, padded = (np.asarray(x) for x in jax.device_get((out[3], pre[2])))
            prompt_routes = np.full_like(padded, -1)
            for i, p in enumerate(prompts):
                prompt_routes[i, :len(p)] = padded[i, P - len(p):]
        return Completions(out_tok, out_lp, lengths, reasons, np.repeat(np.arange(B), n), routes, prompt_routes)

    # --------------------------------------------------------------------------------- multi-turn

    def _stops(self, params: SamplingParams, R: int):
        width = max(1, len(params.stop_ids))
        stop = np.full((R, width), -1, np.int32)
        stop[:, :len(params.stop_ids)] = params.stop_ids
        return stop

    def _finish(self, out, rows: int, seqs, params: SamplingParams):
        tokens, logps, lengths, cache = out
        tokens, logps, lengths, index = jax.device_get((tokens, logps, lengths, cache.index))
        tokens, logps, lengths = (np.asarray(x[:rows]) for x in (tokens, logps, lengths))
        reasons = []
        for t, n in zip(tokens, lengths):
            hit = int(t[n - 1]) in params.stop_ids or any(
                n >= len(q) and all(q[j] < 0 or q[j] == t[n - len(q) + j] for j in range(len(q))) for q in
                (seqs if seqs is not None else ()))
            reasons.append("stop" if hit else "length")
        return tokens, logps, lengths, reasons, cache, int(index)

    def begin(self, prompts: Sequence[Sequence[int]], params: Optional[SamplingParams] = None, *,
              key: Optional[jax.Array] = None, stop_sequences: Sequence[Sequence[int]] = (),
              max_new_tokens: Optional[Sequence[int]] = None) -> tuple[Completions, Turn]:
        """The first turn of multi-turn sampling: `generate` (each prompt prefilled once, its cache shared
        by its `params.n` samples; per-row `max_new_tokens`, one per prompt) that also stops a row at any of
        `stop_sequences` (token-id sequences, kept in the output, e.g. the ids of "</tool_call>") and keeps
        the cache: continue with `extend`."""
        if params is not None and params.record_routes:
            raise PosttrainError("begin: record_routes is supported by generate only (one turn)")
        params = SamplingParams() if params is None else params
        if not prompts or any(len(p) == 0 for p in prompts):
            raise PosttrainError("begin: give at least one prompt, each of at least one token")
        B, M, n = len(prompts), params.max_new_tokens, params.n
        longest = max(len(p) for p in prompts)
        if longest + M > self.max_len:
            raise PosttrainError(f"begin: prompt of {longest} tokens + max_new_tokens {M} exceeds the cache limit "
                                 f"max_len={self.max_len}")
        P = self.bucket(longest)
        toks, segs, pos = (np.full((B, P), self.pad_id, np.int32), np.zeros((B, P), np.int32),
                           np.zeros((B, P), np.int32))
        for i, p in enumerate(prompts):
            toks[i, P - len(p):], segs[i, P - len(p):], pos[i, P - len(p):] = p, 1, np.arange(len(p))
        lens = np.array([len(p) for p in prompts], np.int32)
        row_max = np.full((B,), M, np.int32) if max_new_tokens is None else np.asarray(max_new_tokens, np.int32)
        if row_max.shape != (B,) or (row_max <= 0).any() or (row_max > M).any():
            raise PosttrainError(f"begin: per-prompt max_new_tokens must be {B} values in [1, {M}]")
        seqs = stop_sequence_array(stop_sequences)
        key = jax.random.key(0) if key is None else key
        logits, cache = self._prefill(self._weights, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(segs))
        self.prefill_rows += B
        rows = np.repeat(np.arange(B, dtype=np.int32), n)  # each prompt's prefill shared by its n samples
        cache = self._keep(cache, jnp.asarray(rows), size=P)
        head = {"logits": logits, "next_pos": jnp.asarray(lens), "rows": jnp.asarray(rows)}
        out = self._turn(self._weights, cache, head, key, jnp.asarray(self._stops(params, B * n)),
                         jnp.asarray(np.repeat(row_max, n)), None if seqs is None else jnp.asarray(seqs),
                         params=dataclasses.replace(params, n=1), max_new=M, phases=True)
        tokens, logps, lengths, reasons, cache, index = self._finish(out, B * n, seqs, params)
        turn = Turn(cache, index, lens[rows] + lengths, tokens[np.arange(B * n), lengths - 1], B * n)
        return Completions(tokens, logps, lengths, reasons, rows), turn

    def extend(self, turn: Turn, rows: Sequence[int], appended: Sequence[Sequence[int]],
               params: Optional[SamplingParams] = None, *, key: Optional[jax.Array] = None,
               stop_sequences: Sequence[Sequence[int]] = (),
               max_new_tokens: Optional[Sequence[int]] = None) -> tuple[Completions, Turn]:
        """The next turn: rows `rows` of `turn` (indices; the others are dropped) continue, each after its
        `appended` tokens (e.g. a tool's output). Their cache is EXTENDED, never recomputed: one jitted
        call keeps the rows' caches, prefills [last sampled token | appended tokens] of each row at its
        positions onto them, and decodes (per-row `max_new_tokens`). The batch is a power of two of rows
        (at least 8, at most the first turn's), padded with rows that stop at once; the appended block is
        padded to a multiple of BLOCK_STEP tokens; the cache keeps its size while the turn fits and else
        grows to a multiple of SLOT_STEP slots: few compiled shapes, reused turn after turn.
        Returns the new Completions (prompt_index = the row of `turn` each continues) and Turn."""
        params = SamplingParams() if params is None else params
        if params.n != 1:
            raise PosttrainError("extend: params.n must be 1 (each row continues one sequence)")
        rows = np.asarray(rows, np.int64).reshape(-1)
        if len(rows) == 0 or len(appended) != len(rows) or rows.min() < 0 or rows.max() >= turn.rows:
            raise PosttrainError(f"extend: give one appended token list per kept row, rows in [0, {turn.rows})")
        M, k = params.max_new_tokens, len(rows)
        row_max = np.full((k,), M, np.int32) if max_new_tokens is None else np.asarray(max_new_tokens, np.int32)
        if row_max.shape != (k,) or (row_max <= 0).any() or (row_max > M).any():
            raise PosttrainError(f"extend: per-row max_new_tokens must be {k} values in [1, {M}]")
        blocks = [[int(turn.last[r])] + list(map(int, a)) for r, a in zip(rows, appended)]
        ends = np.array([turn.lengths[r] + len(b) - 1 + m for r, b, m in zip(rows, blocks, row_max)])
        if ends.max() > self.max_len:
            raise PosttrainError(f"extend: a row would reach {int(ends.max())} tokens, more than the sampler's "
                                 f"max_len={self.max_len}; lower the budget or build the Sampler with a larger max_len")
        R = min(turn.max_rows, max(8, 1 << (k - 1).bit_length()))
        R = max(R, k)
        W = round_up(max(map(len, blocks)), BLOCK_STEP)
        toks, segs, pos = (np.full((R, W), self.pad_id, np.int32), np.zeros((R, W), np.int32),
                           np.zeros((R, W), np.int32))
        for j, (r, b) in enumerate(zip(rows, blocks)):
            toks[j, W - len(b):], segs[j, W - len(b):] = b, 1
            pos[j, W - len(b):] = turn.lengths[r] - 1 + np.arange(len(b))
        keep = np.zeros((R,), np.int32)
        keep[:k] = rows
        row_max = np.concatenate([row_max, np.ones((R - k,), np.int32)])  # padding rows stop at once
        seqs = stop_sequence_array(stop_sequences)
        key = jax.random.key(0) if key is None else key
        # the cache keeps its size while the turn fits (one compiled turn for every turn of that size) and
        # grows by SLOT_STEP slots when it does not: the block, then up to M - 1 decode writes
        size = max(turn.cache.size, round_up(turn.index + W + M - 1, SLOT_STEP))
        cache = self._keep(turn.cache, jnp.asarray(keep), size=size)
        head = {"tokens": jnp.asarray(toks), "positions": jnp.asarray(pos), "segments": jnp.asarray(segs)}
        out = self._turn(self._weights, cache, head, key, jnp.asarray(self._stops(params, R)), jnp.asarray(row_max),
                         None if seqs is None else jnp.asarray(seqs), params=params, max_new=M, phases=False)
        tokens, logps, lengths, reasons, cache, index = self._finish(out, k, seqs, params)
        new_len = np.array([turn.lengths[r] + len(b) - 1 for r, b in zip(rows, blocks)]) + lengths
        turn = Turn(cache, index, new_len, tokens[np.arange(k), lengths - 1], turn.max_rows)
        return Completions(tokens, logps, lengths, reasons, rows), turn

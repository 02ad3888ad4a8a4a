"""Sampling parameters and next-token selection (greedy, temperature, top-k, top-p).

What it is: pure functions over a [B, V] logits batch, used inside the sampler's jitted loop.
What it is not: the decode loop (see `sampler.py`).

Log-probabilities: `select` returns log p(token) under softmax(logits / temperature) (temperature 1
for greedy), i.e. the tempered distribution before top-k / top-p truncation. That is exactly what
a trainer recomputes from its own forward pass (TRL and Tunix divide logits by the temperature
too), so sampler and trainer log-probabilities agree on the same tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from posttrain.errors import PosttrainError


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy."""

    max_new_tokens: int = 128  # tokens to generate per row (upper bound; stop tokens end a row early)
    temperature: float = 1.0  # 0 = greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with probability >= top_p; 1 = off
    n: int = 1  # samples per prompt; the prompt is prefilled once and its cache shared
    stop_ids: tuple[int, ...] = ()  # tokens that end a row (included in its output); () = never stop early
    # record the experts every token was routed to in each MoE layer (Completions.routes / prompt_routes),
    # for routing replay in the update (`generate` only)
    record_routes: bool = False

    def __post_init__(self):
        if self.max_new_tokens <= 0:
            raise PosttrainError(f"sampling: max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise PosttrainError(f"sampling: temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise PosttrainError(f"sampling: top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise PosttrainError(f"sampling: top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise PosttrainError(f"sampling: n must be >= 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def truncate(logits, top_k: int, top_p: float):
    """Mask (to -inf) tokens outside the top-k set and outside the top-p nucleus. logits [B, V] float32."""
    neg = jnp.finfo(logits.dtype).min
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        keep_sorted = before < top_p  # the nucleus: the smallest prefix reaching top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, neg)
    return logits


def max_argmax(x):
    """(max, first index of the max) along the last axis, as two plain reductions: the max, then the smallest
    index holding it (jnp.argmax's variadic reduction took 1.5x as long on a CPU: 8 x 2048 logits, 30 -> 20 us)."""
    top = jnp.max(x, axis=-1)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == top[..., None], iota, x.shape[-1]), axis=-1)
    return top, jnp.minimum(first, x.shape[-1] - 1)  # a NaN row matches nowhere: still a token id


def select(logits, key, params: SamplingParams):
    """Pick one token per row. logits [B, V]; returns (tokens [B] int32, logprobs [B] float32)."""
    logits = logits.astype(jnp.float32)
    scaled = logits / params.temperature if params.temperature > 0 else logits
    if params.greedy:
        # log_softmax at the argmax is -log(sum(exp(x - max))): one pass over the vocabulary
        # gives both the token and the shift (the same values as jax.nn.log_softmax).
        top, tok = max_argmax(logits)
        return tok, -jnp.log(jnp.sum(jnp.exp(scaled - top[:, None]), axis=-1))
    tok = jax.random.categorical(key, truncate(scaled, params.top_k, params.top_p), axis=-1).astype(jnp.int32)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


# The KV cache's storage dtypes (`Sampler(kv_dtype=...)`, `rollout.kv_dtype`, `posttrain generate --kv-dtype`;
# models/kv_store.py): float8 halves a bfloat16 cache's bytes (e4m3: 3 mantissa bits, up to 448; e5m2: 2 bits, up to
# 57344), written saturated, cast back where attention reads it; int8 too, with a float32 scale per slot of a cache
# row (amax / 127); the wider ones store keys and values at another precision than the compute dtype.
KV_DTYPES = ("float8_e4m3fn", "float8_e5m2", "int8", "bfloat16", "float16", "float32")


def kv_cache_dtype(name, where: str = "kv_dtype"):
    """The storage dtype named `name` (None: the compute dtype's); a PosttrainError naming `where` and the choices."""
    if name is None:
        return None
    if str(name) not in KV_DTYPES:
        raise PosttrainError(f"{where}: unknown KV cache dtype {name!r}; choose one of {', '.join(KV_DTYPES)} "
                             "(or leave it unset for the compute dtype)")
    return jnp.dtype(str(name))

"""The Sampler's compiled shapes: the prompt buckets, the decode phases the KV cache grows through (`phase_sizes`,
`grow`), the n-fold repeat of a prefill's rows (`repeat_rows`), the block and slot steps of multi-turn sampling, and the
stop tests (`is_stop`, `push`, the stop-sequence array).

What it is: small pure helpers `generate/sampler.py` uses (and re-exports); what it is not: any jitted function.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models.transformer import KVCache


def phase_align(backend: Optional[str] = None) -> int:
    """Slots a decode phase's cache size is a multiple of: 32 on a TPU, 1 elsewhere. A TPU tiles the cache's slot
    axis by 16 (16-bit) or 32 (8-bit) rows; a phase of any other size made XLA copy the cache inside the phase:
    llama3-1b, 192 rows x (128 + 512), the 639-slot last phase needed 4.05 GB of temporaries against 1.10 GB at
    640 (ahead of time for a v5e), and 256 rows of a bfloat16 cache ran out of the chip's memory (17.3 GB)."""
    return 32 if (backend or jax.default_backend()) == "tpu" else 1


def phase_sizes(prompt: int, max_new: int, align: Optional[int] = None) -> list[int]:
    """Cache sizes of the decode phases: up to 4 equal steps from `prompt` to `prompt + max_new - 1`, each rounded
    up to a multiple of `align` slots (None: `phase_align()`; sizes that round alike are one phase).

    Decode attention costs the cache size (measured linear on CPU), so a cache that grows in
    phases saves about a quarter of it; each phase is one more compiled loop body, hence few
    phases, and one for short generations.
    """
    align = phase_align() if align is None else align
    need = max_new - 1  # slots the decode steps write after the prompt
    phases = 1 if need < 64 else min(4, need // 32)
    step = -(-need // phases)
    sizes = [-(-(prompt + min(need, step * (j + 1))) // align) * align for j in range(phases)]
    return sorted(set(sizes))


def grow(cache: KVCache, size: int) -> KVCache:
    """The cache padded with empty slots (pos -1) to `size` slots."""
    extra = size - cache.size
    if extra <= 0:
        return cache

    def pad(x, value=0, axis=2):  # a concatenate: measured ~30 % faster than jnp.pad on CPU
        fill = jnp.full(x.shape[:axis] + (extra,) + x.shape[axis + 1:], value, x.dtype)
        return jnp.concatenate([x, fill], axis=axis)

    return dataclasses.replace(cache.map_kv(lambda x, a: pad(x, 0, a + 2)), pos=pad(cache.pos, -1, axis=1),
                               branch=None if cache.branch is None else pad(cache.branch, 0, axis=1))


def repeat_rows(logits, cache: KVCache, next_pos, n: int):
    """Each prompt's prefill shared by its n samples: its logits, cache and next position repeated n times."""
    if n == 1:
        return logits, cache, next_pos
    rep = functools.partial(jnp.repeat, repeats=n, axis=0)
    cache = dataclasses.replace(cache.map_kv(lambda x, a: jnp.repeat(x, n, axis=a)), pos=rep(cache.pos),
                                branch=None if cache.branch is None else rep(cache.branch),
                                linear=jax.tree.map(rep, cache.linear))  # Gated DeltaNet states
    return rep(logits), cache, rep(next_pos)


def is_stop(tok, hist, stop, seqs):
    """Rows whose token is one of their stop ids [R, W] (-1 = none), or whose last tokens `hist` match a stop
    sequence of `seqs` [Q, L] (right-aligned, -1 = any token; None: none)."""
    hit = jnp.any(tok[:, None] == stop, axis=-1)
    if seqs is not None:
        hit = hit | jnp.any(jnp.all((seqs[None] < 0) | (hist[:, None] == seqs[None]), axis=-1), axis=-1)
    return hit


def push(hist, tok):
    """The last L sampled tokens of each row, `tok` appended (stop sequences only; None without)."""
    return None if hist is None else jnp.concatenate([hist[:, 1:], tok[:, None]], axis=1)


def round_up(x: int, step: int) -> int:
    return -(-x // step) * step


BLOCK_STEP = 16  # appended blocks are padded to a multiple of this many tokens (fewer compiled shapes)
SLOT_STEP = 64  # a later turn's cache holds a multiple of this many slots


def stop_sequence_array(seqs: Sequence[Sequence[int]]) -> Optional[np.ndarray]:
    """[Q, L] int32 stop sequences, right-aligned, -1 = any token (shorter sequences); None for none."""
    seqs = [list(map(int, s)) for s in seqs if len(s)]
    if not seqs:
        return None
    L = max(map(len, seqs))
    out = np.full((len(seqs), L), -1, np.int32)
    for i, q in enumerate(seqs):
        out[i, L - len(q):] = q
    return out


def default_buckets(max_len: int) -> tuple[int, ...]:
    b, out = 16, []
    while b < max_len:
        out.append(b)
        b *= 2
    return tuple(out) + (max_len,)

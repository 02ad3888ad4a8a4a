"""Log-probabilities of continuation tokens in prefix-shared rows (posttrain/data/branches.py).

What it is: `branch_logps(model, batch, num_branches)` runs the model once over the shared rows,
takes the final hidden state at each scored token's source slot (the prompt's last slot for a
branch's first token), computes logits only there (never [B, L, V] over the prompt) and returns
  token_logps [B, M]  log p(score_tgt) under softmax(logits / temperature), 0 on padding entries
  sums        [B, k]  per-branch sums of token_logps * score_w (DPO's sequence log-probs)
  counts      [B, k]  per-branch sums of score_w (completion lengths)
It is the building block of the preference losses (k = 2) and the policy losses (k = n samples).
`token_logps(model, h, tgt)` is the vocabulary step they (and SFT, PPO) share: with a large vocabulary
(SmolLM2's 49k) it computes the float32 logits chunk by chunk along the sequence, each chunk rematerialised
in the backward pass, so a step holds one [B, c, V] chunk (<= LOGIT_BUDGET elements), never [B, M, V].

What it is not: a loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOGIT_BUDGET = 1 << 24  # float32 logit elements one chunk may hold (64 MiB); below it no chunking at all


def chunk_len(rows: int, length: int, vocab: int, budget: int = LOGIT_BUDGET) -> int:
    """Chunk length along the sequence: `length` when [rows, length, vocab] fits the budget, else the
    smallest even split of `length` whose chunks do (at least 1 position)."""
    if rows * length * vocab <= budget:
        return length
    chunks = -(-length // max(1, budget // (rows * vocab)))
    return -(-length // chunks)


def split_chunks(arrays, chunk: int):
    """Arrays [B, T, ...] padded along T to whole chunks of `chunk` positions and stacked as [n, B, chunk, ...]
    (a `lax.scan`'s leading axis); the padding is zeros. Shared by `token_logps` and the distillation loss."""
    T = arrays[0].shape[1]
    n = -(-T // chunk)
    padded = [jnp.pad(a, [(0, 0), (0, n * chunk - T)] + [(0, 0)] * (a.ndim - 2)) for a in arrays]
    return [jnp.moveaxis(a.reshape(a.shape[0], n, chunk, *a.shape[2:]), 1, 0) for a in padded]


def token_logps(model, h, tgt, *, temperature: float = 1.0, with_entropy: bool = False,
                budget: int = LOGIT_BUDGET):
    """(log p(tgt) [B, M], entropy [B, M] or None) under softmax(unembed(h) / temperature), float32, from
    final hidden states h [B, M, D]; chunked along M when [B, M, V] exceeds `budget` (see the module doc)."""

    def part(hc, tc):
        logits = model.unembed(hc).astype(jnp.float32)
        if temperature != 1.0:
            logits = logits / temperature
        lse = jax.nn.logsumexp(logits, axis=-1)
        lp = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0] - lse
        ent = lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1) if with_entropy else None
        return lp, ent

    B, M = tgt.shape
    c = chunk_len(B, M, model.cfg.vocab_size, budget)
    if c >= M:
        return part(h, tgt)
    step = jax.checkpoint(part)  # the backward pass recomputes a chunk's logits instead of keeping them
    _, out = jax.lax.scan(lambda carry, x: (carry, step(*x)), None, split_chunks([h, tgt], c))
    return tuple(None if x is None else jnp.moveaxis(x, 0, 1).reshape(B, -1)[:, :M] for x in out)


def branch_logps(model, batch, num_branches: int, *, temperature: float = 1.0, with_entropy: bool = False,
                 forward=None):
    """(token_logps [B, M], sums [B, k], counts [B, k]) for a batch of prefix-shared rows; with
    `with_entropy` also the entropy [B, M] of each scored position's distribution (0 on padding).
    forward(model, batch, **kw): the model's forward on the rows, when not the plain one (image rows:
    `vision.batched.forward_rows`)."""
    if forward is not None:
        out = forward(model, batch, return_hidden=True, return_logits=False)
    else:
        out = model(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"],
                    branch_ids=batch["branch_ids"], return_hidden=True, return_logits=False,
                    **({"routes": batch["routes"]} if "routes" in batch else {}))  # MoE routing replay (RL rollouts)
    h = jnp.take_along_axis(out.hidden[-1], batch["score_src"][..., None], axis=1)  # [B, M, D]
    tok, ent = token_logps(model, h, batch["score_tgt"], temperature=temperature, with_entropy=with_entropy)
    w = batch["score_w"].astype(jnp.float32)
    tok = jnp.where(w != 0, tok, 0.0)
    onehot = jax.nn.one_hot(batch["score_branch"] - 1, num_branches, dtype=jnp.float32)  # branch 0 (padding) -> 0
    sums = jnp.einsum("bm,bmk->bk", tok * w, onehot)
    counts = jnp.einsum("bm,bmk->bk", w, onehot)
    if with_entropy:
        return tok, sums, counts, jax.lax.stop_gradient(jnp.where(w != 0, ent, 0.0))
    return tok, sums, counts

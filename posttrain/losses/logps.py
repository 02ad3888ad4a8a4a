"""Log-probabilities of continuation tokens in prefix-shared rows (posttrain/data/branches.py).

What it is: `branch_logps(model, batch, num_branches)` runs the model once over the shared rows,
takes the final hidden state at each scored token's source slot (the prompt's last slot for a
branch's first token), computes logits only there (never [B, L, V] over the prompt) and returns
  token_logps [B, M]  log p(score_tgt) under softmax(logits / temperature), 0 on padding entries
  sums        [B, k]  per-branch sums of token_logps * score_w (DPO's sequence log-probs)
  counts      [B, k]  per-branch sums of score_w (completion lengths)
It is the building block of the preference losses (k = 2) and the policy losses (k = n samples).

What it is not: a loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def branch_logps(model, batch, num_branches: int, *, temperature: float = 1.0, with_entropy: bool = False):
    """(token_logps [B, M], sums [B, k], counts [B, k]) for a batch of prefix-shared rows; with
    `with_entropy` also the entropy [B, M] of each scored position's distribution (0 on padding)."""
    out = model(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"],
                branch_ids=batch["branch_ids"], return_hidden=True, return_logits=False)
    h = jnp.take_along_axis(out.hidden[-1], batch["score_src"][..., None], axis=1)  # [B, M, D]
    logits = model.unembed(h).astype(jnp.float32)
    if temperature != 1.0:
        logits = logits / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    tok = jnp.take_along_axis(logits, batch["score_tgt"][..., None], axis=-1)[..., 0] - lse
    w = batch["score_w"].astype(jnp.float32)
    tok = jnp.where(w != 0, tok, 0.0)
    onehot = jax.nn.one_hot(batch["score_branch"] - 1, num_branches, dtype=jnp.float32)  # branch 0 (padding) -> 0
    sums = jnp.einsum("bm,bmk->bk", tok * w, onehot)
    counts = jnp.einsum("bm,bmk->bk", w, onehot)
    if with_entropy:
        ent = lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
        return tok, sums, counts, jax.lax.stop_gradient(jnp.where(w != 0, ent, 0.0))
    return tok, sums, counts

"""Supervised fine-tuning loss: token-level cross-entropy on the masked target tokens.

Exact variant: total = sum_t w_t * (-log softmax(logits_t)[target_t]), denom = sum_t w_t, with
the batch layout of `posttrain.data` (targets[t] = tokens[t + 1] inside a segment, weights = 1
where token t + 1 is a training target). Dividing by denom gives transformers' / TRL's loss:
the mean over all unmasked target tokens of the batch (token-weighted, not per-sequence).
"""

from __future__ import annotations

import jax.numpy as jnp

from posttrain.losses.logps import token_logps


def token_nll(model, hidden, targets):
    """-log p(targets) [B, T] from final hidden states [B, T, D] (after the final norm); float32 log-softmax,
    chunked along T for a large vocabulary (`logps.token_logps`)."""
    return -token_logps(model, hidden, targets)[0]


def text_forward(policy, batch, **kw):
    """The model's forward on a text batch (tokens, positions, segment_ids, optional branch_ids)."""
    return policy(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"],
                  branch_ids=batch.get("branch_ids"), **kw)


def sft_loss(policy, batch, *, frozen=None, rng=None, forward=text_forward):
    """(sum of weighted token NLL, metrics) for a batch of tokens/positions/segment_ids/targets/weights
    (and optionally branch_ids: prefix-shared rows, see models/attention.py). `forward(policy, batch, **kw)` runs
    the model: image rows pass `vision.batched.forward_rows` (the tower's features at the image tokens, [B, 3, T]
    M-RoPE positions), bound by the recipe with functools.partial."""
    out = forward(policy, batch, return_hidden=True, return_logits=False)
    w = batch["weights"].astype(jnp.float32)
    nll = token_nll(policy, out.hidden[-1], batch["targets"])
    total = jnp.sum(nll * w)
    return total, {"denom": jnp.sum(w), "loss": total}

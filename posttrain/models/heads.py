"""Scalar heads on the Transformer: the reward model's `score` (and later a PPO value head).

What it is: `attach_score_head(model, seed=...)` sets `model.score`, a `ScoreParam` [D, L]
(L = num_labels, 1 for a reward model), on an existing Transformer, as `lora.py` attaches
adapters: the model class stays the one forward-only Transformer, so `from_pretrained`,
sharding (logical axes ("embed", None)), LoRA and the train step work unchanged. The language
model head is removed (a sequence classifier has none; its optimizer state would be wasted).
`score_index(...)` picks the slot to score and `last_token_scores(model, hidden, index)`
projects the final hidden states (after the final norm, `out.hidden[-1]`) there; `pair_scores(model,
batch, pad_id=...)` scores both answers of prefix-shared pair rows [prompt | chosen | rejected] in one
forward (the reward model's loss, `losses.reward.make_reward_loss`, takes it as its scorer).

Which token is scored: transformers' `*ForSequenceClassification` (`GenericForSequenceClassification.
forward`, transformers 5.12) scores the RIGHTMOST token that is not `config.pad_token_id` (the
last real token when pad_token_id is None). `score_index` applies that rule, per branch of a
prefix-shared row too (the prompt slots plus the branch's own slots: what the unshared row
[prompt | branch] would hold), so a trained model exported as a HF folder scores the same.
The projection runs in float32 with no bias and no soft-capping, as HF's `score` Linear does.

`ScoreParam` is an `nnx.Param` subtype, so a full fine-tune (`trainable=nnx.Param`) trains it,
and under LoRA the trainer trains `nnx.Any(LoraParam, ScoreParam)` (`TRAINABLE_WITH_LORA`): the
new head is the one full-rank weight a LoRA reward model must learn (TRL + PEFT keep `score` in
`modules_to_save` for the same reason). Initialisation as transformers' `_init_weights` for a
Linear: normal(0, initializer_range = 0.02), here from an explicit seed.

What it is not: a loss (`losses/reward.py`) or a scorer over text (`posttrain.rewards`).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models.lora import LoraParam


class ScoreParam(nnx.Param):
    """The weight of a scalar head [D, num_labels]; trained also when only LoRA adapters are."""


TRAINABLE_WITH_LORA = nnx.Any(LoraParam, ScoreParam)


def attach_score_head(model, *, seed: int = 0, num_labels: int = 1, std: float = 0.02, drop_lm_head: bool = True):
    """Set `model.score` (normal(0, std) [D, num_labels], HF `score.weight` transposed) in place;
    remove the LM head unless `drop_lm_head=False`. Returns the model."""
    cfg = model.cfg
    w = std * jax.random.normal(jax.random.key(seed), (cfg.embed_dim, num_labels), jnp.float32)
    model.score = ScoreParam(w.astype(jnp.dtype(cfg.param_dtype)), out_sharding=("embed", None),
                             eager_sharding=False)
    if drop_lm_head:
        model.lm_head = nnx.data(None)
    return model


def has_score_head(model) -> bool:
    return isinstance(getattr(model, "score", None), ScoreParam)


def score_index(tokens, segment_ids=None, branch_ids=None, branch: Optional[int] = None, pad_id: Optional[int] = None):
    """[B] int32: the slot HF's sequence classifier scores, per row (see the module docstring).

    A slot counts when it is real (segment id != 0), holds no `pad_id` token (when one is given)
    and, with `branch`, lies in the shared prefix (branch 0) or in that branch. A row with no such
    slot gives 0, as HF's argmax over an all-zero row does."""
    B, T = tokens.shape
    ok = jnp.ones((B, T), bool) if segment_ids is None else segment_ids != 0
    if pad_id is not None:
        ok &= tokens != pad_id
    if branch is not None:
        ok &= (branch_ids == 0) | (branch_ids == branch)
    slots = jnp.arange(T, dtype=jnp.int32)
    return jnp.maximum(jnp.max(jnp.where(ok, slots, -1), axis=-1), 0).astype(jnp.int32)


def last_token_scores(model, hidden, index):
    """Scores [B, K, num_labels] of `hidden` [B, T, D] (final, normed) at slots `index` [B, K]
    (or [B, num_labels] for `index` [B]), in float32."""
    h = jnp.take_along_axis(hidden, (index if index.ndim == 2 else index[:, None])[..., None], axis=1)
    s = jnp.einsum("bkd,dl->bkl", h.astype(jnp.float32), model.score[...].astype(jnp.float32))
    return s if index.ndim == 2 else s[:, 0]


def pair_scores(model, batch: dict, *, pad_id: Optional[int]):
    """(chosen [B], rejected [B]) float32 scores of a batch of prefix-shared pair rows: the attention rule
    makes each branch's final hidden states those of the unshared row [prompt | answer], and
    `score_index` picks the slot HF's sequence classifier scores (the rightmost non-pad token)."""
    tokens, seg, br = batch["tokens"], batch["segment_ids"], batch["branch_ids"]
    out = model(tokens, batch["positions"], segment_ids=seg, branch_ids=br, return_hidden=True,
                return_logits=False)
    index = jnp.stack([score_index(tokens, seg, br, b, pad_id) for b in (1, 2)], axis=1)  # [B, 2]
    s = last_token_scores(model, out.hidden[-1], index)[..., 0]  # [B, 2]
    return s[:, 0], s[:, 1]

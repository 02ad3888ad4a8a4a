"""The distillation trainer's loss function: a frozen teacher and the student on the same batch.

What it is: `make_distill_loss(...)` returns `loss_fn(student, batch, *, frozen, rng) -> (total,
metrics)` (the `posttrain.losses` convention: sums over target tokens, `denom` = their count, so
micro-batching is exact). `frozen` is the teacher: its forward runs inside the same jitted step,
under `stop_gradient`, so no gradient is ever built for it. The batch is the SFT layout
(`data/pipeline.py`: tokens, positions, segment_ids, targets, weights); the distilled positions are
those with weight != 0 (the target tokens), so padding, prompts and packing gaps change nothing.

Losses (the pure functions of `losses/distill.py`, summed):
  logit      α·τ²·D(teacher‖student) + (1−α)·CE(labels), D = forward KL, reverse KL or JSD_β,
             optional teacher top-k;
  attention  attention transfer on mapped layers (only those layers' probabilities are formed);
  feature    mapped hidden states (default: the final ones), the teacher pooled to the student's
             width or through a learned projection (`student.distill_projection`, trained with it).
Chunking: logits are formed `chunk_size` positions at a time, inside a `lax.scan` whose body is
rematerialised, so neither model's float32 [B, T, V] logits exist at once (the backward recomputes
a chunk's logits instead of keeping them): memory O(B·chunk·V) instead of O(B·T·V).

Metrics besides the losses (sums per target token, divided by `denom` in the step; the evaluation
hooks, eval_* on a held-out set; `eval_metrics=False`, the trainer's training step, leaves them out,
top1_agreement included):
  teacher_kl      KL(teacher‖student) at temperature 1 over the full vocabulary
  top1_agreement  argmax student == argmax teacher
  logit_cosine    cosine of the centred logit vectors (z − mean z: invariant to the softmax's shift,
                  so a shared offset cannot make unrelated logits look alike)
  hidden_cosine   cosine of the final hidden states, the teacher pooled to the student's width
                  (or projected); absent when neither is possible.

What it is not: the data modes or the trainer (`trainers/distill.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.losses.distill import (
    attention_transfer_loss,
    feature_pool_loss,
    logit_distill_loss,
    pool_features,
)
from posttrain.losses.logps import split_chunks


def _cosine(a, b, eps=1e-8):
    n2 = jnp.sum(jnp.square(a), -1) * jnp.sum(jnp.square(b), -1)
    return jnp.sum(a * b, -1) / jnp.sqrt(jnp.maximum(n2, eps * eps))


def _chunked(fn, arrays, chunk: int):
    """Σ over chunks of `fn(*chunk_arrays) -> (loss, metrics)`; arrays [B, T, ...] split along T.

    Positions past T (padding to a whole number of chunks) carry mask 0, the last array."""
    if not chunk or chunk >= arrays[0].shape[1]:
        return fn(*arrays)
    xs = split_chunks(arrays, chunk)
    body_fn = jax.checkpoint(fn)
    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *[x[0] for x in xs]))

    def body(carry, x):
        return jax.tree.map(jnp.add, carry, body_fn(*x)), None

    return jax.lax.scan(body, zero, xs)[0]


def make_distill_loss(*, strategies=("logit",), temperature: float = 2.0, alpha: float = 0.5,
                      kind: str = "forward_kl", beta: float = 0.5, top_k=None, layer_map=None,
                      attention_kind: str = "mse", attention_weight: float = 1.0, feature_layer_map=None,
                      pool_size=None, projection: bool = False, feature_kind: str = "l2",
                      feature_weight: float = 1.0, chunk_size: int = 256, eval_metrics: bool = True):
    """`loss_fn(student, batch, *, frozen, rng)` for the strategies named (see the module doc).

    `eval_metrics=False` leaves out top1_agreement, teacher_kl, logit_cosine and hidden_cosine (extra
    passes over the logits that a training step need not pay for; the trainer computes them on the
    eval set)."""
    layer_map = dict(layer_map or {})
    feature_layer_map = dict(feature_layer_map or {})
    s_attn = tuple(sorted(layer_map)) if "attention" in strategies else ()
    t_attn = tuple(sorted(set(layer_map.values()))) if "attention" in strategies else ()

    def loss_fn(student, batch, *, frozen=None, rng=None):
        teacher = frozen
        inputs = (batch["tokens"], batch["positions"])
        kw = dict(segment_ids=batch["segment_ids"], branch_ids=batch.get("branch_ids"), return_hidden=True,
                  return_logits=False)
        out_s = student(*inputs, return_attn=s_attn, **kw)
        out_t = jax.lax.stop_gradient(teacher(*inputs, return_attn=t_attn, **kw))
        mask = batch["weights"].astype(jnp.float32)
        h_s, h_t = out_s.hidden[-1], out_t.hidden[-1]
        proj = student.distill_projection[...] if projection else None
        pool = pool_size
        if proj is None and pool is None and h_t.shape[-1] % h_s.shape[-1] == 0:
            pool = h_t.shape[-1] // h_s.shape[-1]

        def logit_terms(hs, ht, labels, m):
            zs, zt = student.unembed(hs).astype(jnp.float32), teacher.unembed(ht).astype(jnp.float32)
            V = min(zs.shape[-1], zt.shape[-1])  # padded vocabularies beyond the shared tokenizer's
            zs, zt = zs[..., :V], jax.lax.stop_gradient(zt[..., :V])
            loss, met = logit_distill_loss(zs, zt, labels, m, temperature=temperature, alpha=alpha, kind=kind,
                                           beta=beta, top_k=top_k, reduction="sum")
            sg = jax.lax.stop_gradient
            if not eval_metrics:  # two argmax passes over the vocabulary; the eval set reports it
                met.pop("top1_agreement")
            else:
                ls, lt = jax.nn.log_softmax(zs, -1), jax.nn.log_softmax(zt, -1)
                fkl = sg(jnp.sum(jnp.exp(lt) * (lt - ls), -1))
                cos = sg(_cosine(zs - zs.mean(-1, keepdims=True), zt - zt.mean(-1, keepdims=True)))
                keep = m != 0
                met = {**met, "teacher_kl": jnp.sum(jnp.where(keep, fkl, 0) * m),
                       "logit_cosine": jnp.sum(jnp.where(keep, cos, 0) * m)}
            if "logit" not in strategies:
                loss = sg(loss) * 0.0
            return loss, met

        total, metrics = _chunked(logit_terms, [h_s, h_t, batch["targets"], mask], chunk_size)
        metrics = {**metrics, "logit_loss": jax.lax.stop_gradient(total)}
        if "attention" in strategies:
            loss, m = attention_transfer_loss(list(out_s.attn), list(out_t.attn), layer_map, mask,
                                              weight=attention_weight, kind=attention_kind, reduction="sum")
            total, metrics = total + loss, {**metrics, "attn_loss": m["attn_loss"]}
        if "feature" in strategies:
            if feature_layer_map:
                hs, ht = list(out_s.hidden), list(out_t.hidden)
            else:
                hs, ht = h_s, h_t
            loss, m = feature_pool_loss(hs, ht, mask, pool_size=None if proj is not None else pool_size,
                                        projection=proj, kind=feature_kind, layer_map=feature_layer_map or None,
                                        weight=feature_weight, reduction="sum")
            total, metrics = total + loss, {**metrics, "feature_loss": m["feature_loss"]}
        if eval_metrics and (proj is not None or pool is not None):
            mapped = pool_features(jax.lax.stop_gradient(h_t).astype(jnp.float32), h_s.shape[-1],
                                   pool_size=None if proj is not None else pool,
                                   projection=None if proj is None else jax.lax.stop_gradient(proj))
            cos = jax.lax.stop_gradient(_cosine(h_s.astype(jnp.float32), mapped))
            metrics["hidden_cosine"] = jnp.sum(jnp.where(mask != 0, cos, 0) * mask)
        metrics["loss"] = total
        return total, metrics

    return loss_fn

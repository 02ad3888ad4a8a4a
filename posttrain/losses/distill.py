"""Knowledge-distillation losses: logit distillation (KL / reverse KL / generalised JSD), attention
transfer and feature pooling, all masked to real target tokens.

What this is: pure `jnp` functions from student and teacher outputs (logits, attention probabilities,
hidden states) to a scalar loss, jit-able (every keyword is a static Python value), computed in at
least float32 (bfloat16 inputs are upcast; float64 stays float64) and masked: a position whose mask
is 0 changes nothing, not even when it holds garbage (`jnp.where`, not a multiply, so inf/nan there
cannot leak into the value). What it is not: the forwards producing those outputs (a frozen teacher
and the student, `Transformer(..., return_hidden=True, return_attn=True)`), or the trainer.

Teacher inputs are always constants (`stop_gradient`): the teacher is frozen. Gradients flow into
the student's arrays and into a caller-owned `projection` (feature pooling).

Shapes: B batch, T query positions, S key positions, V vocab, N heads, D width.
  `mask`  [B, T] weights, 1 on the real target tokens, 0 on padding / prompt / packing gaps (bool or
          float). Every "mean over masked tokens" below is Σ_t m_t·x_t / max(Σ_t m_t, 1): token-
          weighted over the whole batch (so packing rows together or apart does not change it),
          and 0 (not nan) for an all-masked batch, as TRL clamps.
`reduction="sum"` (where offered) returns Σ_t m_t·x_t instead, with `metrics["denom"] = Σ_t m_t` and
every metric a sum too: the `loss_fn` convention of `posttrain.losses`, exact under micro-batching.

Formulas (p = softmax(z/τ) of the teacher, q of the student, per token, sums over the vocabulary):
  KL(p‖q)         = Σ_v p_v (log p_v − log q_v)                      ("forward_kl", β = 0)
  KL(q‖p)                                                              ("reverse_kl", β = 1)
  JSD_β(p, q)     = β·KL(p‖m) + (1−β)·KL(q‖m),  m = β·p + (1−β)·q     (0 < β < 1)
                    Generalised JSD of GKD (Agarwal et al. 2024, arXiv 2306.13649, eq. 1), with TRL
                    1.16's conventions: β = 0 and β = 1 are the two KLs above (special-cased, since
                    JSD_β → 0 at both ends), the mixture is built in log space (logsumexp).
  logit distill   α·τ²·D(p‖q) + (1−α)·CE(softmax(z_s), labels)       Hinton et al. 2015 (arXiv
                    1503.02531): the τ² keeps the soft-target gradient's scale independent of τ; CE
                    is at temperature 1 on the hard labels.

References: Hinton, Vinyals & Dean 2015 (1503.02531); GKD, Agarwal et al. 2024 (2306.13649); TRL 1.16
`trl/experimental/gkd/gkd_trainer.py::GKDTrainer.generalized_jsd_loss`; TinyBERT, Jiao et al. 2020
(1909.10351, attention MSE, eq. 7); MiniLM, Wang et al. 2020 (2002.10957, attention KL, eq. 5);
DistilBERT, Sanh et al. 2019 (1910.01108, cosine hidden-state loss); FitNets, Romero et al. 2015
(1412.6550, hidden-state L2 through a learned regressor).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from posttrain.errors import PosttrainError

LOGIT_KINDS = ("forward_kl", "reverse_kl", "jsd")
ATTENTION_KINDS = ("mse", "kl")
FEATURE_KINDS = ("l2", "cosine")
_REDUCTIONS = ("mean", "sum")


# --------------------------------------------------------------------------- helpers


def _up(x):
    """x in at least float32 (bf16 → f32, f64 stays f64): log-softmax and sums never run in bf16."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _weights(mask, shape, dtype, what):
    if mask is None:
        return jnp.ones(shape, dtype)
    mask = jnp.asarray(mask)
    if mask.shape != tuple(shape):
        raise PosttrainError(f"{what}: mask has shape {mask.shape}, expected {tuple(shape)} (one weight per "
                             "token: 1 on real target tokens, 0 on padding)")
    return mask.astype(dtype)


def _masked(x, w, reduction):
    """(Σ m·x or Σ m·x / max(Σ m, 1), Σ m); masked entries are dropped with where (garbage-proof)."""
    total = jnp.sum(jnp.where(w != 0, x, 0) * w)
    denom = jnp.sum(w)
    return (total if reduction == "sum" else total / jnp.maximum(denom, 1)), denom


def _check_reduction(reduction, what):
    if reduction not in _REDUCTIONS:
        raise PosttrainError(f"{what}: reduction={reduction!r}; expected one of {list(_REDUCTIONS)}")


def _divergence(s_logp, t_logp, beta):
    """Per-token divergence [...] from log-probs [..., V] exactly as TRL 1.16 builds it (see module doc)."""
    if beta == 0:  # KL(teacher ‖ student); TRL: F.kl_div(student, teacher, log_target=True)
        return jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp), axis=-1)
    if beta == 1:  # KL(student ‖ teacher)
        return jnp.sum(jnp.exp(s_logp) * (s_logp - t_logp), axis=-1)
    b = jnp.asarray(beta, s_logp.dtype)
    m_logp = jnp.logaddexp(s_logp + jnp.log1p(-b), t_logp + jnp.log(b))
    kl_t = jnp.sum(jnp.exp(t_logp) * (t_logp - m_logp), axis=-1)
    kl_s = jnp.sum(jnp.exp(s_logp) * (s_logp - m_logp), axis=-1)
    return b * kl_t + (1 - b) * kl_s


def _check_logits(student_logits, teacher_logits, what):
    if student_logits.shape != teacher_logits.shape:
        raise PosttrainError(f"{what}: student logits {student_logits.shape} and teacher logits "
                             f"{teacher_logits.shape} differ; distillation needs the same [B, T, V] "
                             "(same tokenizer and vocabulary, the same target positions)")


def _check_beta_temperature(beta, temperature, what):
    if not 0.0 <= beta <= 1.0:
        raise PosttrainError(f"{what}: beta={beta} must be in [0, 1] (0 = KL(teacher‖student), "
                             "1 = KL(student‖teacher))")
    if not temperature > 0:
        raise PosttrainError(f"{what}: temperature={temperature} must be > 0")


# --------------------------------------------------------------------------- logits


def generalized_jsd(student_logits, teacher_logits, mask=None, *, beta=0.5, temperature=1.0):
    """Generalised JSD [scalar] of GKD, as TRL 1.16's `GKDTrainer.generalized_jsd_loss`.

    Logits [B, T, V] (the rows that predict the target tokens), `mask` [B, T]. Both logit sets are
    divided by `temperature`, log-softmaxed, and the per-token JSD_β of the module doc is averaged
    over the masked tokens: Σ_t m_t·JSD_t / max(Σ_t m_t, 1). That is TRL's `reduction="batchmean"`
    with `labels` (labels == -100 ⇔ m_t = 0): TRL's "batchmean" divides by the number of unmasked
    tokens, not by the batch size, and clamps it to ≥ 1. Quirks kept from TRL: no τ² factor (use
    `logit_distill_loss` for Hinton scaling); β = 0 / 1 switch to the plain KLs. Difference from TRL:
    `mask=None` averages over all B·T tokens, whereas TRL with `labels=None` divides the total by B.
    `beta` must be a Python number (it selects the branch); the teacher is a constant.
    """
    _check_logits(student_logits, teacher_logits, "generalized_jsd")
    _check_beta_temperature(beta, temperature, "generalized_jsd")
    s = jax.nn.log_softmax(_up(student_logits) / temperature, axis=-1)
    t = jax.nn.log_softmax(jax.lax.stop_gradient(_up(teacher_logits)) / temperature, axis=-1)
    w = _weights(mask, s.shape[:-1], s.dtype, "generalized_jsd")
    return _masked(_divergence(s, t, beta), w, "mean")[0]


def logit_distill_loss(student_logits, teacher_logits, labels=None, mask=None, *, temperature=2.0, alpha=0.5,
                       kind="forward_kl", beta=0.5, top_k=None, reduction="mean"):
    """(loss, metrics) of Hinton logit distillation mixed with cross-entropy on the labels.

      loss = α·τ²·D_t + (1 − α)·CE_t, mean over masked tokens (or the sum, `reduction="sum"`)
      D_t  = KL(p‖q) ("forward_kl"), KL(q‖p) ("reverse_kl") or JSD_β(p, q) ("jsd", β = `beta`) of
             p = softmax(z_teacher/τ), q = softmax(z_student/τ); the same code as `generalized_jsd`.
      CE_t = −log softmax(z_student)[label_t] at temperature 1.
    `labels` [B, T] int in [0, V) where mask ≠ 0 (any value where mask = 0, e.g. -100; an out-of-range
    label at a real position gives nan, JAX's gather fill); required unless α = 1.

    `top_k=k`: both distributions are restricted to the teacher's k largest logits K_t (per token,
    `lax.top_k`, ties by lowest index) and renormalised over them: p_v ∝ exp(z_t,v/τ), q_v ∝
    exp(z_s,v/τ) for v ∈ K_t, and D_t is taken over those k entries. Renormalising the student too
    keeps student == teacher ⇒ D = 0 with zero gradient; the student's mass outside K_t is left to
    the CE term. k = V is the full loss. (This is the form used with stored sparse teacher logits.)

    Metrics (means, or sums with `reduction="sum"`): `kl` = D_t (before α·τ²), `ce`, `top1_agreement`
    (argmax student == argmax teacher over the full vocabulary), `denom` = Σ m_t.
    `temperature`, `alpha`, `kind`, `beta`, `top_k` are static Python values.
    """
    what = "logit_distill_loss"
    _check_logits(student_logits, teacher_logits, what)
    _check_beta_temperature(beta, temperature, what)
    _check_reduction(reduction, what)
    if kind not in LOGIT_KINDS:
        raise PosttrainError(f"{what}: kind={kind!r}; expected one of {list(LOGIT_KINDS)}")
    if not 0.0 <= alpha <= 1.0:
        raise PosttrainError(f"{what}: alpha={alpha} must be in [0, 1] (1 = pure distillation, 0 = pure CE)")
    if labels is None and alpha != 1:
        raise PosttrainError(f"{what}: alpha={alpha} mixes in cross-entropy on the labels; pass labels, or use "
                             "alpha=1.0 for pure distillation")
    zs = _up(student_logits)
    zt = jax.lax.stop_gradient(_up(teacher_logits)).astype(zs.dtype)
    vocab = zs.shape[-1]
    w = _weights(mask, zs.shape[:-1], zs.dtype, what)

    ks, kt = zs, zt
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab:
            raise PosttrainError(f"{what}: top_k={top_k!r} must be an int in [1, {vocab}] (the vocabulary size)")
        kt, idx = jax.lax.top_k(zt, top_k)
        ks = jnp.take_along_axis(zs, idx, axis=-1)
    b = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(kind, beta)
    div = _divergence(jax.nn.log_softmax(ks / temperature, axis=-1),
                      jax.nn.log_softmax(kt / temperature, axis=-1), b)

    per_token = alpha * temperature**2 * div
    if labels is not None:
        safe = jnp.where(w != 0, jnp.asarray(labels), 0)  # ignore-index values (-100) at masked positions
        ce = jax.nn.logsumexp(zs, axis=-1) - jnp.take_along_axis(zs, safe[..., None], axis=-1)[..., 0]
        if alpha != 1:
            per_token = per_token + (1 - alpha) * ce
    else:
        ce = jnp.zeros_like(div)
    agree = (jnp.argmax(zs, axis=-1) == jnp.argmax(zt, axis=-1)).astype(zs.dtype)

    loss, denom = _masked(per_token, w, reduction)
    metrics = {
        "kl": _masked(div, w, reduction)[0],
        "ce": _masked(ce, w, reduction)[0],
        "top1_agreement": jax.lax.stop_gradient(_masked(agree, w, reduction)[0]),
        "denom": denom,
    }
    return loss, metrics


# --------------------------------------------------------------------------- layer maps and pooling


def check_layer_map(layer_map, num_student_layers, num_teacher_layers, *, key="layer_map"):
    """Validate a {student layer: teacher layer} map; a PosttrainError naming `key` and the bad layer."""
    if not isinstance(layer_map, Mapping) or not layer_map:
        raise PosttrainError(f"{key}: expected a non-empty mapping {{student layer: teacher layer}}, got "
                             f"{layer_map!r}")
    for s, t in layer_map.items():
        for side, layer, n in (("student", s, num_student_layers), ("teacher", t, num_teacher_layers)):
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
                raise PosttrainError(f"{key}: {side} layer {layer!r} (in {s!r}: {t!r}) does not exist; the "
                                     f"{side} has {n} layers, numbered 0..{n - 1}")
    return dict(layer_map)


def check_pool_size(pool_size, student_width, teacher_width, *, key="pool_size"):
    """The pool size mapping a teacher width onto the student's (None → teacher_width / student_width).

    Raises a PosttrainError naming `key` when the pool size does not divide the teacher width or does not
    land on the student width.
    """
    if pool_size is None:
        if teacher_width % student_width:
            raise PosttrainError(f"{key}: the teacher width {teacher_width} is not a multiple of the student width "
                                 f"{student_width}, so average pooling cannot map one onto the other; use a "
                                 "learned projection [teacher_width, student_width] instead")
        return teacher_width // student_width
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
        raise PosttrainError(f"{key}: pool_size={pool_size!r} must be a positive int")
    if teacher_width % pool_size:
        raise PosttrainError(f"{key}: pool_size={pool_size} does not divide the teacher width {teacher_width}")
    if teacher_width // pool_size != student_width:
        hint = (f"use pool_size={teacher_width // student_width}" if teacher_width % student_width == 0
                else "use a learned projection [teacher_width, student_width]")
        raise PosttrainError(f"{key}: pool_size={pool_size} pools the teacher width {teacher_width} to "
                             f"{teacher_width // pool_size}, not the student width {student_width}; {hint}")
    return pool_size


def _pairs(student, teacher, layer_map, what):
    """[(student array, teacher array)] from two arrays, or from two per-layer lists and a layer map."""
    if isinstance(student, Sequence) != isinstance(teacher, Sequence):
        raise PosttrainError(f"{what}: pass both student and teacher as per-layer lists, or both as arrays")
    if not isinstance(student, Sequence):
        if layer_map is not None:
            raise PosttrainError(f"{what}: layer_map needs per-layer lists of student and teacher outputs")
        return [(student, teacher)]
    if layer_map is None:
        raise PosttrainError(f"{what}: per-layer lists need a layer_map {{student layer: teacher layer}}")
    layer_map = check_layer_map(layer_map, len(student), len(teacher))
    return [(student[s], teacher[t]) for s, t in sorted(layer_map.items())]


# --------------------------------------------------------------------------- attention transfer


def attention_transfer_loss(student_attn, teacher_attn, layer_map, mask=None, *, weight=1.0, kind="mse",
                            reduction="mean"):
    """(loss, metrics) of attention transfer between the attention probabilities of mapped layers.

    `student_attn` / `teacher_attn`: per-layer lists of [B, N, T, S] softmax probabilities (rows sum
    to 1 over the real keys, 0 on masked keys); `layer_map` {student layer: teacher layer}. Per pair:
      heads   N_s == N_t: head n against head n. Otherwise both are averaged over their heads to one
              head (the mean of distributions is a distribution), so any head counts can be paired.
      row     "mse": Σ_s (A_s − A_t)² (TinyBERT eq. 7 on probabilities; summed, not averaged, over
              keys, so padded keys (0 in both) and the key count change nothing);
              "kl":  Σ_s A_t·(log A_t − log A_s) = KL(teacher row ‖ student row) (MiniLM eq. 5);
              0·log 0 terms are 0.
      loss    weight · mean over pairs of [mean over heads, then mean over masked query rows].
    Packing is free: with block-diagonal (segment) attention a packed row's keys outside the
    query's segment are 0 in both, so the per-row value equals the unpacked one.
    Metrics: `attn_loss` (before weight), `denom` = Σ m_t; sums with `reduction="sum"`.
    """
    what = "attention_transfer_loss"
    _check_reduction(reduction, what)
    if kind not in ATTENTION_KINDS:
        raise PosttrainError(f"{what}: kind={kind!r}; expected one of {list(ATTENTION_KINDS)}")
    if not isinstance(student_attn, Sequence) or not isinstance(teacher_attn, Sequence):
        raise PosttrainError(f"{what}: student_attn and teacher_attn must be per-layer lists of [B, N, T, S]")
    per_row, w = 0.0, None
    for i, (a_s, a_t) in enumerate(_pairs(student_attn, teacher_attn, layer_map, what)):
        a_s, a_t = _up(a_s), jax.lax.stop_gradient(_up(a_t))
        if a_s.ndim != 4 or a_t.ndim != 4 or a_s.shape[0] != a_t.shape[0] or a_s.shape[2:] != a_t.shape[2:]:
            raise PosttrainError(f"{what}: pair {i} has student {a_s.shape} and teacher {a_t.shape}; both "
                                 "must be [B, N, T, S] with the same B, T and S")
        a_t = a_t.astype(a_s.dtype)
        if a_s.shape[1] != a_t.shape[1]:
            a_s, a_t = a_s.mean(axis=1, keepdims=True), a_t.mean(axis=1, keepdims=True)
        if kind == "mse":
            row = jnp.sum(jnp.square(a_s - a_t), axis=-1)
        else:
            pos = a_t > 0
            log_t = jnp.log(jnp.where(pos, a_t, 1))
            log_s = jnp.log(jnp.where(pos, a_s, 1))
            row = jnp.sum(jnp.where(pos, a_t * (log_t - log_s), 0), axis=-1)
        if w is None:
            w = _weights(mask, (a_s.shape[0], a_s.shape[2]), a_s.dtype, what)
        # Garbage at masked query rows must not reach the head mean: zero it first.
        row = jnp.where((w != 0)[:, None, :], row, 0)
        per_row = per_row + row.mean(axis=1)
    per_row = per_row / len(layer_map)
    value, denom = _masked(per_row, w, reduction)
    return weight * value, {"attn_loss": value, "denom": denom}


# --------------------------------------------------------------------------- feature pooling


def pool_features(teacher_hidden, student_width, *, pool_size=None, projection=None):
    """Teacher hidden [..., D_t] → [..., D_s]: mean of each run of `pool_size` consecutive features
    (feature j = mean(h[j·P : (j+1)·P])), or `h @ projection` with a caller-owned [D_t, D_s] matrix."""
    d_t = teacher_hidden.shape[-1]
    if projection is not None:
        if pool_size is not None:
            raise PosttrainError("feature_pool_loss: give pool_size or projection, not both")
        if tuple(projection.shape) != (d_t, student_width):
            raise PosttrainError(f"feature_pool_loss: projection has shape {tuple(projection.shape)}, expected "
                                 f"[teacher_width, student_width] = [{d_t}, {student_width}]")
        return teacher_hidden @ _up(projection).astype(teacher_hidden.dtype)
    p = check_pool_size(pool_size, student_width, d_t)
    return teacher_hidden.reshape(*teacher_hidden.shape[:-1], student_width, p).mean(axis=-1)


def feature_pool_loss(student_hidden, teacher_hidden, mask=None, *, pool_size=None, projection=None, kind="l2",
                      layer_map=None, weight=1.0, eps=1e-8, reduction="mean"):
    """(loss, metrics) between student hidden states and teacher hidden states mapped to the student width.

    `student_hidden` [B, T, D_s], `teacher_hidden` [B, T, D_t] (or per-layer lists of them with a
    `layer_map` {student layer: teacher layer}, the loss then averaged over the pairs). The teacher
    is mapped by `pool_features` (average pooling, `pool_size` = D_t / D_s by default; or the
    `projection` [D_t, D_s], which receives gradients: train it with the student, FitNets-style).
    Per token, with h_s the student and h_t the mapped teacher:
      "l2":     mean_d (h_s − h_t)²  (mean over features, so the scale does not grow with width)
      "cosine": 1 − h_s·h_t / max(‖h_s‖·‖h_t‖, eps)  (DistilBERT's cosine embedding loss)
    then weight · mean over masked tokens. Metrics: `feature_loss` (before weight), `denom`.
    """
    what = "feature_pool_loss"
    _check_reduction(reduction, what)
    if kind not in FEATURE_KINDS:
        raise PosttrainError(f"{what}: kind={kind!r}; expected one of {list(FEATURE_KINDS)}")
    pairs = _pairs(student_hidden, teacher_hidden, layer_map, what)
    per_tok, w = 0.0, None
    for i, (h_s, h_t) in enumerate(pairs):
        h_s, h_t = _up(h_s), jax.lax.stop_gradient(_up(h_t))
        if h_s.ndim != 3 or h_t.ndim != 3 or h_s.shape[:2] != h_t.shape[:2]:
            raise PosttrainError(f"{what}: pair {i} has student {h_s.shape} and teacher {h_t.shape}; both must "
                                 "be [B, T, D] with the same B and T")
        h_t = pool_features(h_t.astype(h_s.dtype), h_s.shape[-1], pool_size=pool_size, projection=projection)
        if kind == "l2":
            tok = jnp.mean(jnp.square(h_s - h_t), axis=-1)
        else:
            n2 = jnp.sum(jnp.square(h_s), -1) * jnp.sum(jnp.square(h_t), -1)
            tok = 1 - jnp.sum(h_s * h_t, -1) / jnp.sqrt(jnp.maximum(n2, eps * eps))
        if w is None:
            w = _weights(mask, h_s.shape[:2], h_s.dtype, what)
        per_tok = per_tok + jnp.where(w != 0, tok, 0)
    value, denom = _masked(per_tok / len(pairs), w, reduction)
    return weight * value, {"feature_loss": value, "denom": denom}

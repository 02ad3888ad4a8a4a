"""Distillation losses: parity with TRL 1.16's GKD code (float64), invariants, masking and errors.

TRL reference: `trl.experimental.gkd.gkd_trainer.GKDTrainer.generalized_jsd_loss`, a static method,
called on torch float64 tensors with labels = -100 where our mask is 0 (its default
`reduction="batchmean"`). The Hinton mix is checked against α·τ²·(that function) + (1 − α)·torch's
`F.cross_entropy(ignore_index=-100)`. Differences are float64 round-off (~1e-16).
Invariants: student == teacher ⇒ every distillation loss 0 with zero gradients; padded positions
(garbage, mask 0) and packing two sequences into one row change nothing.
"""

from __future__ import annotations

import functools
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.errors import PosttrainError
from posttrain.losses import (
    attention_transfer_loss,
    check_layer_map,
    check_pool_size,
    feature_pool_loss,
    generalized_jsd,
    logit_distill_loss,
    pool_features,
)

B, T, V = 3, 6, 9
TOL = 1e-6
ZERO = 1e-10  # "0 to float error" in float64


pytestmark = pytest.mark.usefixtures("x64")  # float64 in these tests only (conftest)


@pytest.fixture(scope="module")
def trl():
    import torch  # test dependencies: a missing one is an error, never a silent skip
    import torch.nn.functional as F

    with warnings.catch_warnings():  # "importing from trl.experimental" is expected here
        warnings.simplefilter("ignore")
        from trl.experimental.gkd.gkd_trainer import GKDTrainer

    return types.SimpleNamespace(torch=torch, F=F, jsd=GKDTrainer.generalized_jsd_loss)


def _data(seed=0, b=B, t=T, v=V):
    rng = np.random.default_rng(seed)
    s = rng.normal(size=(b, t, v)) * 2.0
    te = rng.normal(size=(b, t, v)) * 2.0
    labels = rng.integers(0, v, size=(b, t))
    mask = rng.random((b, t)) < 0.7
    mask[0, 0] = True
    mask[-1] = False  # one row with no target tokens at all
    return s, te, np.where(mask, labels, -100), mask


def _t(torch, x):
    return torch.tensor(np.asarray(x), dtype=torch.float64 if np.asarray(x).dtype.kind == "f" else torch.long)


# --------------------------------------------------------------------------- TRL parity
# (each test jits all its cases into one function: one compile, the file stays fast)

JSD_CASES = [(beta, tau) for beta in (0.0, 0.5, 1.0) for tau in (1.0, 2.0)]


@pytest.mark.parity
def test_generalized_jsd_matches_trl(trl):
    """β ∈ {0, 0.5, 1} × τ ∈ {1, 2}, and an all-masked batch (TRL clamps the token count to 1 → 0)."""
    s, te, labels, mask = _data()
    ours = jax.jit(lambda s, te, m: [generalized_jsd(s, te, m, beta=b, temperature=t) for b, t in JSD_CASES])
    none = np.zeros((B, T), bool)
    for got, got_none, (beta, tau) in zip(ours(s, te, mask), ours(s, te, none), JSD_CASES, strict=True):
        ref = trl.jsd(_t(trl.torch, s), _t(trl.torch, te), labels=_t(trl.torch, labels), beta=beta,
                      temperature=tau).item()
        assert abs(float(got) - ref) <= TOL, (beta, tau, float(got), ref)
        ref_none = trl.jsd(_t(trl.torch, s), _t(trl.torch, te), labels=_t(trl.torch, np.full((B, T), -100)),
                           beta=beta, temperature=tau).item()
        assert float(got_none) == ref_none == 0.0


@pytest.mark.parity
def test_logit_distill_is_hinton_mix_of_trl_jsd_and_torch_ce(trl):
    s, te, labels, mask = _data(2)
    tau, alpha = 2.0, 0.3
    cases = [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.3)]
    ours = jax.jit(lambda s, te, lab, m: [logit_distill_loss(s, te, lab, m, temperature=tau, alpha=alpha, kind=k,
                                                             beta=0.3) for k, _ in cases])(s, te, labels, mask)
    ts, tt, tl = _t(trl.torch, s), _t(trl.torch, te), _t(trl.torch, labels)
    ce = trl.F.cross_entropy(ts.reshape(-1, V), tl.reshape(-1), ignore_index=-100).item()
    agree = (s.argmax(-1) == te.argmax(-1))[mask].mean()
    for (loss, m), (kind, beta) in zip(ours, cases, strict=True):
        d = trl.jsd(ts, tt, labels=tl, beta=beta, temperature=tau).item()
        assert abs(float(m["kl"]) - d) <= TOL, kind
        assert abs(float(m["ce"]) - ce) <= TOL, kind
        assert abs(float(loss) - (alpha * tau**2 * d + (1 - alpha) * ce)) <= TOL, kind
        assert abs(float(m["top1_agreement"]) - agree) <= TOL, kind
        assert float(m["denom"]) == mask.sum()


def test_top_k_restricts_both_distributions_to_teacher_top_k():
    s, te, labels, mask = _data(3)
    k, tau = 3, 2.0
    full, all_k, (_, m) = jax.jit(lambda s, te, lab, msk: (
        logit_distill_loss(s, te, lab, msk)[0], logit_distill_loss(s, te, lab, msk, top_k=V)[0],
        logit_distill_loss(s, te, None, msk, alpha=1.0, top_k=k, temperature=tau)))(s, te, labels, mask)
    assert abs(float(full) - float(all_k)) <= 1e-12
    idx = np.argsort(-te, axis=-1, kind="stable")[..., :k]

    def logp(z):
        z = np.take_along_axis(z, idx, -1) / tau
        return z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)

    lp_t, lp_s = logp(te), logp(s)
    kl = (np.exp(lp_t) * (lp_t - lp_s)).sum(-1)
    assert abs(float(m["kl"]) - kl[mask].mean()) <= 1e-12


# --------------------------------------------------------------------------- student == teacher


def _all_zero(cases, *args):
    """Every case (name → scalar fn of args) is 0 with zero gradients at args, in one jit."""
    vg = jax.jit(lambda *a: {n: jax.value_and_grad(f, argnums=tuple(range(len(a))))(*a) for n, f in cases.items()})
    for name, (val, grads) in vg(*args).items():
        g = max(float(np.abs(np.asarray(x)).max()) for x in grads)
        assert abs(float(val)) <= ZERO and g <= ZERO, (name, float(val), g)


def test_identical_logits_zero_loss_and_gradient():
    z, _, _, mask = _data(4)
    cases = {f"{kind}/top_k={k}": functools.partial(
        lambda a, kind, k: logit_distill_loss(a, z, None, mask, alpha=1.0, kind=kind, top_k=k)[0], kind=kind, k=k)
        for kind in ("forward_kl", "reverse_kl", "jsd") for k in (None, 4)}
    cases |= {f"gjsd/beta={b}": functools.partial(
        lambda a, b: generalized_jsd(a, z, mask, beta=b, temperature=2.0), b=b) for b in (0.0, 0.5, 1.0)}
    _all_zero(cases, jnp.asarray(z))


def _attn_scores(seed, layers, heads, b=2, t=5):
    """Per-layer attention logits [B, N, T, T] (causally masked by `_softmax_causal`)."""
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(b, heads, t, t)) * 2 for _ in range(layers)]


def _softmax_causal(x):
    t = x.shape[-1]
    causal = np.tril(np.ones((t, t), bool))
    return jax.nn.softmax(jnp.where(causal, x, -jnp.inf), axis=-1)


def _attn_probs(seed, layers, heads, b, t):
    """Per-layer causal attention probabilities [B, N, T, T] in numpy (test data without eager jax ops)."""
    out = []
    for x in _attn_scores(seed, layers, heads, b=b, t=t):
        x = np.where(np.tril(np.ones((t, t), bool)), np.asarray(x), -np.inf)
        e = np.exp(x - x.max(-1, keepdims=True))
        out.append(e / e.sum(-1, keepdims=True))
    return out


def test_identical_attention_zero_loss_and_gradient():
    """Gradients w.r.t. the student's attention scores (pre-softmax): what reaches the weights."""
    t_scores = _attn_scores(6, 3, 4)
    teacher = _attn_probs(6, 3, 4, 2, 5)
    mask = np.array([[1, 1, 1, 0, 1], [0, 1, 1, 1, 1]], bool)
    layer_map = {0: 2, 1: 0}
    same_heads = [t_scores[layer_map[i]] for i in range(2)]
    # 2 student heads whose head average is the teacher's: pair-means of the teacher's 4 heads
    with np.errstate(divide="ignore"):  # log 0 = -inf above the diagonal, masked again by the causal softmax
        two_heads = [np.log(0.5 * (teacher[layer_map[i]][:, 0::2] + teacher[layer_map[i]][:, 1::2]))
                     for i in range(2)]

    def f(kind, sl):
        return lambda *sc: attention_transfer_loss([_softmax_causal(x) for x in sc[sl]], teacher, layer_map, mask,
                                                   kind=kind)[0]

    # one head count per kind keeps this to one small compile (both kinds share the head handling)
    _all_zero({"mse/4 heads": f("mse", slice(0, 2)), "kl/2 heads": f("kl", slice(2, 4))}, *same_heads, *two_heads)


def test_identical_features_zero_loss_and_gradient_and_formulas():
    rng = np.random.default_rng(9)
    h_t = rng.normal(size=(2, 5, 12))
    mask = rng.random((2, 5)) < 0.8
    pooled = h_t.reshape(2, 5, 4, 3).mean(-1)
    proj = rng.normal(size=(12, 5))
    cases = {}  # every case takes (pooled student, projected student, projection)
    for kind in ("l2", "cosine"):
        cases[f"pool/{kind}"] = functools.partial(
            lambda s, sp, p, kind: feature_pool_loss(s, h_t, mask, kind=kind)[0], kind=kind)
        cases[f"projection/{kind}"] = functools.partial(
            lambda s, sp, p, kind: feature_pool_loss(sp, h_t, mask, projection=p, kind=kind)[0], kind=kind)
    _all_zero(cases, pooled, h_t @ proj, proj)

    # the formulas, against numpy
    h_s, h_t = rng.normal(size=(2, 4, 3)), rng.normal(size=(2, 4, 6))
    mask = np.array([[1, 1, 0, 1], [1, 0, 0, 1]], bool)
    p = h_t.reshape(2, 4, 3, 2).mean(-1)
    l2 = ((h_s - p) ** 2).mean(-1)[mask].mean()
    cos = (1 - (h_s * p).sum(-1) / np.linalg.norm(h_s, axis=-1) / np.linalg.norm(p, axis=-1))[mask].mean()
    # (and a student unlike the teacher: the gradient reaches the learned projection)
    both = jax.jit(lambda a, b, m, p: (feature_pool_loss(a, b, m)[0],
                                       feature_pool_loss(a, b, m, pool_size=2, kind="cosine")[0],
                                       jax.grad(lambda p: feature_pool_loss(a, b, m, projection=p)[0])(p)))
    got_l2, got_cos, gp = both(h_s, h_t, mask, rng.normal(size=(6, 3)))
    assert abs(float(got_l2) - l2) <= 1e-12 and abs(float(got_cos) - cos) <= 1e-12
    assert np.abs(np.asarray(gp)).max() > 1e-3
    assert np.allclose(pool_features(h_t, 3), p)


# --------------------------------------------------------------------------- padding, packing, the combined loss


def _pad(x, n, fill, axis=1):
    shape = list(x.shape)
    shape[axis] = n
    return np.concatenate([x, np.full(shape, fill) if np.isscalar(fill) else fill(shape)], axis=axis)


def test_padding_and_packing_change_nothing():
    """All three strategies at once (one compile per layout): values, metrics and student gradients
    are unchanged by masked garbage positions (finite or not) and by packing the rows into one."""
    b, t = 2, 4
    rng = np.random.default_rng(11)
    s, te, labels, _ = _data(11, b=b, t=t)
    mask = np.array([[1, 1, 0, 1], [1, 1, 1, 0]], bool)
    labels = np.where(mask, rng.integers(0, V, size=(b, t)), -100)
    a_s, a_t = _attn_probs(14, 1, 2, b, t), _attn_probs(15, 2, 4, b, t)
    h_s, h_t = rng.normal(size=(b, t, 3)), rng.normal(size=(b, t, 6))
    def dl(*, mask, student_logits, teacher_logits, labels, student_attn, teacher_attn, student_hidden,
           teacher_hidden):  # the three strategies summed, as make_distill_loss sums them
        parts = [logit_distill_loss(student_logits, teacher_logits, labels, mask, alpha=0.4, kind="jsd"),
                 attention_transfer_loss(student_attn, teacher_attn, {0: 1}, mask, kind="kl"),
                 feature_pool_loss(student_hidden, teacher_hidden, mask, kind="cosine")]
        return sum(p[0] for p in parts), {k: v for p in parts for k, v in p[1].items()}

    vg = jax.jit(jax.value_and_grad(lambda x, rest: dl(**x, **rest), has_aux=True))

    def run(s, te, labels, mask, a_s, a_t, h_s, h_t):  # numpy out: no eager op (= compile) on the results
        return jax.device_get(vg(dict(student_logits=s, student_attn=a_s, student_hidden=h_s),
                  dict(teacher_logits=te, labels=labels, mask=mask, teacher_attn=a_t, teacher_hidden=h_t)))

    (l0, m0), g0 = run(s, te, labels, mask, a_s, a_t, h_s, h_t)
    assert all(float(m0[k]) > 1e-3 for k in ("kl", "ce", "attn_loss", "feature_loss")), m0

    def same(l1, m1, what):
        assert abs(float(l1) - float(l0)) <= 1e-12, what
        for k in m0:
            assert abs(float(m1[k]) - float(m0[k])) <= 1e-12, (what, k)

    # padding: t more positions of garbage, mask 0; attention gets t garbage query rows and t key
    # columns that are 0 for the real rows (a model never attends a padded key). Padded and packed
    # layouts are both [b, 2t]: one compile for both.
    garbage = lambda shape: rng.normal(size=shape) * 1e3  # noqa: E731

    def pad_attn(a):
        a = np.concatenate([a, np.zeros(a.shape[:3] + (t,))], axis=3)
        return np.concatenate([a, garbage(a.shape[:2] + (t, 2 * t))], axis=2)

    padded = [_pad(s, t, garbage), _pad(te, t, garbage), _pad(labels, t, -100), _pad(mask, t, False),
              [pad_attn(a) for a in a_s], [pad_attn(a) for a in a_t], _pad(h_s, t, garbage), _pad(h_t, t, garbage)]
    (l1, m1), g1 = run(*padded)
    same(l1, m1, "padded")
    np.testing.assert_allclose(g1["student_logits"][:, :t], g0["student_logits"], atol=1e-12)
    np.testing.assert_allclose(g1["student_hidden"][:, :t], g0["student_hidden"], atol=1e-12)
    for g_pad, g_ref in zip(g1["student_attn"], g0["student_attn"], strict=True):
        np.testing.assert_allclose(g_pad[:, :, :t, :t], g_ref, atol=1e-12)
        assert np.abs(g_pad[:, :, t:]).max() == 0.0
    assert np.abs(g1["student_logits"][:, t:]).max() == 0.0
    # non-finite garbage at masked positions does not reach the value either
    for i in (0, 1, 6, 7):
        padded[i][:, t:] = np.nan if i % 2 == 0 else np.inf
    for a in padded[4] + padded[5]:
        a[:, :, t:] = np.nan
    (l2, m2), _ = run(*padded)
    same(l2, m2, "non-finite padding")

    # packing: both rows in row 0 (block-diagonal, i.e. per-segment, attention), row 1 all padding
    def pack(x):
        out = garbage((b, 2 * t) + x.shape[2:]).astype(x.dtype)
        out[0] = x.reshape(b * t, *x.shape[2:])
        return out

    def pack_attn(a):
        out = garbage((b, a.shape[1], 2 * t, 2 * t))
        out[0] = 0.0
        out[0, :, :t, :t], out[0, :, t:, t:] = a[0], a[1]
        return out

    packed_mask = np.zeros((b, 2 * t), bool)
    packed_mask[0] = mask.reshape(-1)
    packed_labels = np.where(packed_mask, pack(labels % V), -100)
    (l3, m3), g3 = run(pack(s), pack(te), packed_labels, packed_mask, [pack_attn(a) for a in a_s],
                       [pack_attn(a) for a in a_t], pack(h_s), pack(h_t))
    same(l3, m3, "packed")
    np.testing.assert_allclose(g3["student_logits"][0], np.asarray(g0["student_logits"]).reshape(b * t, -1),
                               atol=1e-12)
    np.testing.assert_allclose(g3["student_hidden"][0], np.asarray(g0["student_hidden"]).reshape(b * t, -1),
                               atol=1e-12)


def test_sum_reduction_is_the_mean_times_the_token_count():
    """reduction="sum" (the loss_fn convention make_distill_loss uses) gives Σ_t m_t·x_t with denom Σ_t m_t."""
    s, te, labels, mask = _data(17)
    rng = np.random.default_rng(18)
    a_s, a_t = _attn_probs(19, 2, 2, B, T), _attn_probs(20, 3, 4, B, T)
    h_s, h_t = rng.normal(size=(B, T, 4)), rng.normal(size=(B, T, 8))
    for fn in (lambda r: logit_distill_loss(s, te, labels, mask, temperature=3.0, alpha=0.7, kind="jsd", beta=0.2,
                                            top_k=5, reduction=r),
               lambda r: attention_transfer_loss(a_s, a_t, {0: 2, 1: 1}, mask, weight=0.5, kind="kl", reduction=r),
               lambda r: feature_pool_loss(h_s, h_t, mask, pool_size=2, kind="cosine", weight=2.0, reduction=r)):
        (mean, _), (total, m) = fn("mean"), fn("sum")
        assert float(m["denom"]) == mask.sum()
        assert abs(float(total) - float(mean) * mask.sum()) <= 1e-9 * max(1.0, abs(float(total)))


def test_bfloat16_inputs_compute_in_float32():
    s, te, labels, mask = _data(21)
    with jax.enable_x64(False):
        sb, tb = jnp.asarray(s, jnp.bfloat16), jnp.asarray(te, jnp.bfloat16)
        (loss, _), (ref, _) = jax.jit(lambda a, b, a32, b32: (
            logit_distill_loss(a, b, labels, mask, kind="jsd"),
            logit_distill_loss(a32, b32, labels, mask, kind="jsd")))(sb, tb, sb.astype(jnp.float32),
                                                                   tb.astype(jnp.float32))
        assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
        assert abs(float(loss) - float(ref)) <= 1e-5


# --------------------------------------------------------------------------- errors


def test_bad_inputs_raise_posttrain_error_naming_the_key():
    a = [np.full((1, 2, 3, 3), 1 / 3)] * 2
    with pytest.raises(PosttrainError, match=r"layer_map: teacher layer 5 .*0\.\.1"):
        attention_transfer_loss(a, a, {0: 5}, np.ones((1, 3)))
    with pytest.raises(PosttrainError, match=r"layer_map: student layer 2 "):
        check_layer_map({2: 0}, 2, 4)
    with pytest.raises(PosttrainError, match=r"pool_size: pool_size=5 does not divide the teacher width 12"):
        feature_pool_loss(np.ones((1, 2, 3)), np.ones((1, 2, 12)), None, pool_size=5)
    with pytest.raises(PosttrainError, match=r"pool_size: pool_size=2 .* not the student width 3; use pool_size=4"):
        check_pool_size(2, 3, 12)
    with pytest.raises(PosttrainError, match="pool_size: the teacher width 10 is not a multiple"):
        feature_pool_loss(np.ones((1, 2, 3)), np.ones((1, 2, 10)), None)
    with pytest.raises(PosttrainError, match="projection has shape"):
        feature_pool_loss(np.ones((1, 2, 3)), np.ones((1, 2, 10)), None, projection=np.ones((10, 4)))
    with pytest.raises(PosttrainError, match="kind='kl2'"):
        logit_distill_loss(np.ones((1, 2, 3)), np.ones((1, 2, 3)), None, None, alpha=1.0, kind="kl2")
    with pytest.raises(PosttrainError, match="top_k=7"):
        logit_distill_loss(np.ones((1, 2, 3)), np.ones((1, 2, 3)), None, None, alpha=1.0, top_k=7)
    with pytest.raises(PosttrainError, match="pass labels"):
        logit_distill_loss(np.ones((1, 2, 3)), np.ones((1, 2, 3)), None, None, alpha=0.5)
    with pytest.raises(PosttrainError, match="logits"):
        generalized_jsd(np.ones((1, 2, 3)), np.ones((1, 2, 4)), None)

"""Preference losses: parity with TRL 1.16's own trainer code (float64), and invariants.

TRL references are TRL's real code paths, driven through stand-ins for what they need around
the maths (no model, no accelerator, no trainer __init__):
  DPO      `DPOTrainer._compute_loss(self, model, inputs)` unbound: `self` a SimpleNamespace with
           the attributes it reads, `model` a callable returning fixed per-token log-probs (what
           TRL's fused LM head returns), reference log-probs precomputed in `inputs`. Every
           loss_type goes through the same path, per pair (one-pair batches) and per batch.
  SimPO    `CPOTrainer.get_batch_loss_metrics` (loss_type="simpo", cpo_alpha=0) over a model
           returning fixed random logits, and `CPOTrainer.cpo_loss` for per-pair losses.
  ORPO     `ORPOTrainer.get_batch_loss_metrics` the same way (NLL + odds ratio), and
           `ORPOTrainer.odds_ratio_loss` for per-pair terms.
  RM       `RewardTrainer.compute_loss` over a model returning fixed scalar rewards.
Differences are float64 round-off (~1e-15) except where TRL itself drops to float32: ORPO's
`odds_ratio_loss` casts with `.float()` and exo_pair builds eps as a float32 tensor (~1e-7).
"""

from __future__ import annotations

import math
import types
import warnings
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.losses import (
    DPO_LOSS_TYPES,
    bco_update_running_mean,
    dpo_loss,
    orpo_loss,
    reward_loss,
    simpo_loss,
)

P, K, L, V = 8, 3, 14, 11  # pairs, prompt tokens, row length, vocab (for the logits-based references)
TOL = 1e-6
COUPLED = {"aot", "aot_unpaired", "sft"}  # losses that mix the pairs of a batch


pytestmark = pytest.mark.usefixtures("x64")  # float64 in these tests only (conftest)


@pytest.fixture(scope="module")
def trl():
    import torch  # test dependencies: a missing one is an error, never a silent skip
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.reward_trainer import RewardTrainer

    with warnings.catch_warnings():  # "importing from trl.experimental" is expected here
        warnings.simplefilter("ignore")
        from trl.experimental.cpo.cpo_trainer import CPOTrainer
        from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    return types.SimpleNamespace(torch=torch, DPOTrainer=DPOTrainer, CPOTrainer=CPOTrainer,
                                 ORPOTrainer=ORPOTrainer, RewardTrainer=RewardTrainer)


def _accelerator(torch):
    return types.SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x,
                                 unwrap_model=lambda m: m)


def _metrics():
    return defaultdict(lambda: defaultdict(list))


def _close(a, b, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = np.max(np.abs(a - b))
    assert err <= TOL, f"{what}: max |Δ| = {err:.3g}\nours {a}\nTRL  {b}"


# ---------------------------------------------------------------------------------------- DPO


def _dpo_rows(seed):
    """Chosen/rejected rows: K prompt tokens, then a completion of 1..L-K tokens, then padding."""
    rng = np.random.default_rng(seed)
    out = {}
    for side in ("chosen", "rejected"):
        lengths = rng.integers(1, L - K + 1, size=P)
        lengths[0], lengths[1] = 1, L - K  # the extremes
        pos = np.arange(L)[None]
        completion = ((pos >= K) & (pos < K + lengths[:, None])).astype(np.int64)
        tok = -rng.uniform(0.01, 3.0, size=(P, L - 1)) * completion[:, 1:]  # log p of token t+1, 0 off-completion
        attention = (pos < K + lengths[:, None]).astype(np.int64)
        out[side] = dict(lengths=lengths, completion=completion, attention=attention, tok=tok, logps=tok.sum(1),
                         ref=tok.sum(1) + rng.normal(0.0, 4.0, size=P))
    return out


def _trl_dpo(trl, rows, idx, loss_type, beta, eps, tau=0.05):
    """(loss, mean chosen reward, mean rejected reward) from DPOTrainer._compute_loss on pairs idx."""
    torch = trl.torch
    c, r = rows["chosen"], rows["rejected"]

    def cat(key):
        return torch.from_numpy(np.concatenate([c[key][idx], r[key][idx]]))

    n = len(idx)
    per_token = cat("tok")
    outputs = types.SimpleNamespace(
        log_probs=per_token, entropy=torch.zeros_like(per_token), mean_logits=torch.zeros_like(per_token),
        is_top1=torch.zeros(per_token.shape, dtype=torch.bool), aux_loss=None)
    model = lambda **kw: outputs  # noqa: E731  (TRL calls model(input_ids=..., labels=..., fused_lm_head=True))
    self = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), ref_model=None, accelerator=_accelerator(torch),
        aux_loss_enabled=False, precompute_ref_logps=True, ld_alpha=None, f_divergence_type="reverse_kl",
        loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=eps, use_weighting=False,
        args=types.SimpleNamespace(discopop_tau=tau, gradient_checkpointing_kwargs=None),
        _metrics=_metrics(), _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros((2 * n, L), dtype=torch.long), "attention_mask": cat("attention"),
              "completion_mask": cat("completion"), "ref_chosen_logps": torch.from_numpy(c["ref"][idx]),
              "ref_rejected_logps": torch.from_numpy(r["ref"][idx])}
    loss = trl.DPOTrainer._compute_loss(self, model, inputs, return_outputs=False)
    assert loss.dtype == torch.float64
    m = self._metrics["train"]
    return loss.item(), m["rewards/chosen"][-1], m["rewards/rejected"][-1]


def _ours_dpo(rows, idx, loss_type, beta, eps, tau=0.05):
    c, r = rows["chosen"], rows["rejected"]
    return dpo_loss(jnp.asarray(c["logps"][idx]), jnp.asarray(r["logps"][idx]), jnp.asarray(c["ref"][idx]),
                    jnp.asarray(r["ref"][idx]), loss_type=loss_type, beta=beta, label_smoothing=eps,
                    chosen_lengths=jnp.asarray(c["lengths"][idx]), rejected_lengths=jnp.asarray(r["lengths"][idx]),
                    discopop_tau=tau)


@pytest.mark.parity
@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("beta", [0.1, 0.7])
@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_matches_trl(trl, loss_type, beta, eps):
    if loss_type == "exo_pair" and eps == 0.0:
        eps = 1e-3  # EXO needs eps > 0 (TRL refuses 0 at init); 1e-3 is the paper's value
    rows = _dpo_rows(seed=int(beta * 10) + int(eps * 100))
    everything = np.arange(P)
    losses, ch, rj = _ours_dpo(rows, everything, loss_type, beta, eps)
    assert losses.dtype == ch.dtype == rj.dtype == jnp.float64 and losses.shape == (P,)

    # The batch: mean loss and mean rewards.
    t_loss, t_ch, t_rj = _trl_dpo(trl, rows, everything, loss_type, beta, eps)
    _close(jnp.mean(losses), t_loss, f"{loss_type} batch loss")
    _close([jnp.mean(ch), jnp.mean(rj)], [t_ch, t_rj], f"{loss_type} batch rewards")

    # Per pair: TRL on one-pair batches; ours from the batch call, or (for losses that mix the
    # batch) also on one-pair batches.
    ref = np.array([_trl_dpo(trl, rows, np.array([i]), loss_type, beta, eps) for i in range(P)])
    if loss_type in COUPLED:
        mine = np.array([[float(x[0]) for x in _ours_dpo(rows, np.array([i]), loss_type, beta, eps)]
                         for i in range(P)])
    else:
        mine = np.stack([np.asarray(losses), np.asarray(ch), np.asarray(rj)], axis=1)
    _close(mine, ref, f"{loss_type} per-pair (loss, chosen reward, rejected reward)")


def test_dpo_policy_equals_reference():
    """π = π_ref ⇒ sigmoid loss log 2 exactly and zero rewards."""
    logps = jnp.asarray(np.random.default_rng(1).uniform(-50, -1, size=(2, P)))
    losses, ch, rj = dpo_loss(logps[0], logps[1], logps[0], logps[1])
    np.testing.assert_allclose(losses, math.log(2), rtol=0, atol=1e-15)
    assert not np.any(np.asarray(ch)) and not np.any(np.asarray(rj))


def test_dpo_sigmoid_gradient_sign():
    """Raising a chosen log-prob raises the margin and lowers the loss; raising a rejected one does the opposite."""
    rng = np.random.default_rng(2)
    c, r, rc, rr = (jnp.asarray(rng.uniform(-40, -5, size=P)) for _ in range(4))

    def total(c, r):
        return jnp.sum(dpo_loss(c, r, rc, rr, beta=0.1)[0])

    g_c, g_r = jax.grad(total, argnums=(0, 1))(c, r)
    assert g_c.dtype == jnp.float64
    assert np.all(np.asarray(g_c) < 0) and np.all(np.asarray(g_r) > 0)
    np.testing.assert_allclose(g_c, -g_r, rtol=0, atol=1e-15)
    # The rewards are logged values: no gradient flows through them (TRL detaches them).
    assert not np.any(np.asarray(jax.grad(lambda c: jnp.sum(dpo_loss(c, r, rc, rr)[1]))(c)))


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_jits_and_keeps_float32(loss_type):
    """Every type traces under jit (no data-dependent Python), and float32 in gives float32 out."""
    rows = _dpo_rows(seed=3)
    c, r = rows["chosen"], rows["rejected"]
    args = [jnp.asarray(x, jnp.float32) for x in (c["logps"], r["logps"], c["ref"], r["ref"])]
    fn = jax.jit(lambda a, b, x, y, lc, lr: dpo_loss(a, b, x, y, loss_type=loss_type, label_smoothing=0.1,
                                                     chosen_lengths=lc, rejected_lengths=lr))
    out = fn(*args, jnp.asarray(c["lengths"], jnp.int32), jnp.asarray(r["lengths"], jnp.int32))
    assert all(o.dtype == jnp.float32 and o.shape == (P,) for o in out)
    assert np.all(np.isfinite(np.asarray(out[0])))


def test_dpo_bad_arguments():
    x = jnp.zeros(P)
    with pytest.raises(ValueError, match="unknown DPO loss_type"):
        dpo_loss(x, x, x, x, loss_type="kto_pair")
    with pytest.raises(ValueError, match="chosen_lengths and rejected_lengths"):
        dpo_loss(x, x, x, x, loss_type="ipo")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, loss_type="exo_pair")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, loss_type="robust", label_smoothing=0.5)


def test_bco_running_mean():
    """δ = 0 is TRL 1.16's bco_pair; a running mean δ shifts both rewards; the helper averages batch means."""
    rng = np.random.default_rng(4)
    c, r, rc, rr = (jnp.asarray(rng.uniform(-40, -5, size=P)) for _ in range(4))
    plain = dpo_loss(c, r, rc, rr, loss_type="bco_pair")
    np.testing.assert_array_equal(dpo_loss(c, r, rc, rr, loss_type="bco_pair", bco_running_mean=0.0)[0], plain[0])

    mean, count = 0.0, 0
    batch_means = []
    for _ in range(3):
        _, ch, rj = dpo_loss(c, r, rc, rr, loss_type="bco_pair")
        mean, count = bco_update_running_mean(mean, count, ch, rj)
        batch_means.append(float(jnp.mean(jnp.concatenate([ch, rj]))))
        c = c + 1.0
    assert count == 3
    np.testing.assert_allclose(mean, np.mean(batch_means), rtol=1e-14)
    losses, ch, rj = dpo_loss(c, r, rc, rr, loss_type="bco_pair", bco_running_mean=mean)
    want = -jax.nn.log_sigmoid(ch - mean) - jax.nn.log_sigmoid(-(rj - mean))
    np.testing.assert_allclose(losses, want, rtol=1e-14)


# ------------------------------------------------------------------------------ SimPO and ORPO


def _lm_batch(seed):
    """A tokenized pair batch as TRL's CPO/ORPO collators give it, fixed random logits for it, and
    our inputs computed from those logits (summed completion log-probs, lengths, chosen NLL)."""
    rng = np.random.default_rng(seed)
    batch, logits, ours = {}, [], {}
    nll_sum, nll_count = 0.0, 0
    for side in ("chosen", "rejected"):
        lengths = rng.integers(1, L - K + 1, size=P)
        lengths[0] = L - K
        pos = np.arange(L)[None]
        attention = (pos < K + lengths[:, None]).astype(np.int64)
        ids = rng.integers(1, V, size=(P, L)) * attention
        labels = np.where((pos >= K) & (attention == 1), ids, -100)
        lg = rng.normal(0.0, 2.0, size=(P, L, V))
        logp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
        tok = np.take_along_axis(logp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]  # log p(token t+1)
        ours[f"{side}_logps"] = (tok * (labels[:, 1:] != -100)).sum(1)
        ours[f"{side}_lengths"] = lengths
        if side == "chosen":  # ORPO's SFT term: every non-padding chosen token after the first
            nll_sum, nll_count = -(tok * attention[:, 1:]).sum(), attention[:, 1:].sum()
        batch.update({f"{side}_input_ids": ids, f"{side}_attention_mask": attention, f"{side}_labels": labels})
        logits.append(lg)
    ours["chosen_nll"] = nll_sum / nll_count
    return batch, np.concatenate(logits), ours


def _lm_self(trl, cls, batch, logits, **attrs):
    torch = trl.torch
    out = types.SimpleNamespace(logits=torch.from_numpy(logits))
    model = lambda input_ids, **kw: out  # noqa: E731
    self = types.SimpleNamespace(is_encoder_decoder=False, aux_loss_enabled=False, accelerator=_accelerator(torch),
                                 pad_token_id=0, padding_value=0, **attrs)
    for name in ("concatenated_forward", "cpo_loss", "odds_ratio_loss"):
        if hasattr(cls, name):
            setattr(self, name, types.MethodType(getattr(cls, name), self))
    self.concatenated_inputs, self.get_batch_logps = cls.concatenated_inputs, cls.get_batch_logps
    tbatch = {k: torch.from_numpy(v) for k, v in batch.items()}
    return self, model, tbatch


@pytest.mark.parity
@pytest.mark.parametrize("beta,gamma,eps", [(2.0, 0.5, 0.0), (0.5, 1.2, 0.15)])
def test_simpo_matches_trl(trl, beta, gamma, eps):
    batch, logits, ours = _lm_batch(seed=5)
    self, model, tbatch = _lm_self(trl, trl.CPOTrainer, batch, logits, beta=beta, simpo_gamma=gamma, alpha=0.0,
                                   label_smoothing=eps, loss_type="simpo", cpo_alpha=0.0)
    t_loss, metrics = trl.CPOTrainer.get_batch_loss_metrics(self, model, tbatch)
    t_c, t_r = self.concatenated_forward(model, tbatch)[:2]  # TRL's own length-averaged log-probs
    t_losses, t_ch, t_rj = self.cpo_loss(t_c, t_r)

    losses, ch, rj = simpo_loss(jnp.asarray(ours["chosen_logps"]), jnp.asarray(ours["rejected_logps"]),
                                jnp.asarray(ours["chosen_lengths"]), jnp.asarray(ours["rejected_lengths"]),
                                beta=beta, gamma=gamma, label_smoothing=eps)
    assert losses.dtype == jnp.float64
    _close(jnp.mean(losses), t_loss.item(), "SimPO batch loss")
    _close([jnp.mean(ch), jnp.mean(rj)], [metrics["rewards/chosen"], metrics["rewards/rejected"]], "SimPO rewards")
    _close(np.stack([losses, ch, rj]), np.stack([t.numpy() for t in (t_losses, t_ch, t_rj)]), "SimPO per pair")


@pytest.mark.parity
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_matches_trl(trl, beta):
    batch, logits, ours = _lm_batch(seed=6)
    self, model, tbatch = _lm_self(trl, trl.ORPOTrainer, batch, logits, beta=beta)
    t_loss, metrics = trl.ORPOTrainer.get_batch_loss_metrics(self, model, tbatch)
    t_c, t_r = self.concatenated_forward(model, tbatch)[:2]
    t_terms, t_ch, t_rj = self.odds_ratio_loss(t_c, t_r)[:3]  # per pair: beta·logσ(log odds), rewards

    args = [jnp.asarray(ours[k]) for k in ("chosen_logps", "rejected_logps", "chosen_lengths", "rejected_lengths")]
    losses, ch, rj = orpo_loss(*args, beta=beta, chosen_nll=ours["chosen_nll"])
    odds_only = orpo_loss(*args, beta=beta)[0]
    assert losses.dtype == jnp.float64
    _close(ours["chosen_nll"], metrics["nll_loss"], "ORPO NLL input (documented recipe vs TRL)")
    _close(jnp.mean(losses), t_loss.item(), "ORPO batch loss")
    _close([jnp.mean(ch), jnp.mean(rj)], [metrics["rewards/chosen"], metrics["rewards/rejected"]], "ORPO rewards")
    # TRL's odds_ratio_loss works in float32 (`.float()`), hence the tolerance rather than round-off.
    _close(np.stack([odds_only, ch, rj]), np.stack([-t_terms.numpy(), t_ch.numpy(), t_rj.numpy()]), "ORPO per pair")


# ---------------------------------------------------------------------------------- reward model


def _trl_reward(trl, chosen, rejected, margin, coef):
    torch = trl.torch
    out = types.SimpleNamespace(logits=torch.from_numpy(np.concatenate([chosen, rejected]))[:, None])
    self = types.SimpleNamespace(model=types.SimpleNamespace(training=True), accelerator=_accelerator(torch),
                                 args=types.SimpleNamespace(center_rewards_coefficient=coef),
                                 _metrics=_metrics(), _total_train_tokens=0, _tp_size=1)
    n = len(chosen)
    inputs = {"input_ids": torch.zeros((2 * n, 4), dtype=torch.long),
              "attention_mask": torch.ones((2 * n, 4), dtype=torch.long)}
    if margin is not None:
        inputs["margin"] = torch.from_numpy(margin)
    return trl.RewardTrainer.compute_loss(self, lambda **kw: out, inputs).item()


@pytest.mark.parity
@pytest.mark.parametrize("use_margin", [False, True])
@pytest.mark.parametrize("coef", [None, 0.01])
def test_reward_loss_matches_trl(trl, use_margin, coef):
    rng = np.random.default_rng(7)
    chosen, rejected = rng.normal(0.5, 2.0, size=P), rng.normal(-0.5, 2.0, size=P)
    margin = rng.uniform(0.0, 2.0, size=P) if use_margin else None

    def ours(idx):
        m = None if margin is None else jnp.asarray(margin[idx])
        out = reward_loss(jnp.asarray(chosen[idx]), jnp.asarray(rejected[idx]), margin=m, center_coefficient=coef)
        assert out.dtype == jnp.float64 and out.shape == ()
        return float(out)

    _close(ours(slice(None)), _trl_reward(trl, chosen, rejected, margin, coef), "reward batch loss")
    per_pair_ref = [_trl_reward(trl, chosen[i:i + 1], rejected[i:i + 1], None if margin is None else margin[i:i + 1],
                                coef) for i in range(P)]
    _close([ours(slice(i, i + 1)) for i in range(P)], per_pair_ref, "reward per pair")


def test_reward_loss_equal_rewards_is_log2():
    x = jnp.asarray(np.random.default_rng(8).normal(size=P))
    np.testing.assert_allclose(reward_loss(x, x), math.log(2), rtol=0, atol=1e-15)

"""GRPO-family policy loss and sampler correction: parity with TRL 1.16's own trainer code (float64), and
invariants. The advantages: tests/test_advantages_trl.py; the stand-ins both drive TRL with: tests/trl_stand_ins.py.

TRL references are TRL's real code paths, driven through stand-ins for what they need around the
maths (no model, no generation, no accelerator, no trainer __init__):
  Policy loss      `GRPOTrainer._compute_loss(self, model, inputs)` unbound: `self` carries the config
                   attributes, `_get_per_token_logps_and_entropies` returns a fixed leaf tensor of
                   per-token log-probs; old and reference log-probs, advantages and the token count
                   come in `inputs`. Loss, every metric TRL logs, and the gradient of the loss with
                   respect to the log-probs (torch autograd vs jax.grad) are compared.
Grid: every TRL 1.16 loss_type (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo) x importance
sampling level (token, sequence) x epsilon_high (0.2, 0.28) x (beta, use_bias_correction_kl) in
{(0, -), (0.04, True), (0.04, False)}; plus the two-sided δ cap, the on-policy path (no old log-probs)
and a global token count. Differences are float64 round-off (~1e-16) except where TRL itself rounds to float32
(~1e-8): SAPO's temperatures come from `torch.where` on Python floats (float32), and the clip-fraction metrics
average `bool.float()` tensors.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trl_stand_ins import NG, _accelerator, _close, _completion_lists, _generation_self, _metrics, _reward_table

from posttrain.losses import POLICY_LOSS_TYPES, policy_loss, token_kl

N, T = 8, 7  # samples (2 prompts x 4), completion positions
LENGTHS = np.array([7, 1, 4, 0, 6, 3, 7, 2])  # one sample without tokens (a masked truncated completion)
MAX_COMPLETION_LENGTH = 10
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
METRIC_NAMES = {  # TRL's logged key -> ours
    "kl": "kl", "clip_ratio/low_mean": "clip_low_mean", "clip_ratio/high_mean": "clip_high_mean",
    "clip_ratio/region_mean": "clip_region_mean", "clip_ratio/low_min": "clip_low_min",
    "clip_ratio/high_max": "clip_high_max", "cispo_clip_ratio": "cispo_clip_ratio",
    "vespo/phi_seq_mean": "vespo_phi_seq_mean",
}

pytestmark = pytest.mark.usefixtures("x64")  # float64 in these tests only (conftest)


# ----------------------------------------------------------------------------------- policy loss


def _policy_data(seed=18):
    rng = np.random.default_rng(seed)
    mask = (np.arange(T)[None] < LENGTHS[:, None]).astype(np.int64)
    new = -rng.uniform(0.05, 3.0, size=(N, T))
    # Old log-probs a per-token and a per-sample shift away: ratios on both sides of every clip range,
    # at token and at sequence level.
    old = new + rng.normal(0.0, 0.3, size=(N, T)) + rng.normal(0.0, 0.2, size=(N, 1))
    ref = new + rng.normal(0.0, 0.5, size=(N, T))
    adv = rng.normal(0.0, 1.0, size=N)
    adv[2] = 0.0
    return dict(new=new, old=old, ref=ref, adv=adv, mask=mask)


def _trl_policy_loss(trl, d, *, loss_type, level, epsilon_high, beta, bias, delta=None, on_policy=False,
                     num_items=None):
    """(loss, {our metric name: value}, d loss / d new_logps) from GRPOTrainer._compute_loss."""
    torch = trl.torch
    new = torch.from_numpy(d["new"].copy()).requires_grad_(True)
    self = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda model, *a, **kw: (new, torch.zeros_like(new), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=epsilon_high,
        args=types.SimpleNamespace(use_bias_correction_kl=bias, delta=delta, sapo_temperature_pos=1.0,
                                   sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                                   vespo_lambda_neg=2.0, steps_per_generation=1),
        use_vllm=False, vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=MAX_COMPLETION_LENGTH,
        accelerator=_accelerator(torch), _entropy_bonus_enabled=False, _metrics=_metrics(),
        get_gamma_weights=trl.GRPOTrainer.get_gamma_weights)
    mask = torch.from_numpy(d["mask"])
    inputs = {"prompt_ids": torch.ones((N, 2), dtype=torch.long), "prompt_mask": torch.ones((N, 2), dtype=torch.long),
              "completion_ids": torch.ones((N, T), dtype=torch.long), "completion_mask": mask,
              "advantages": torch.from_numpy(d["adv"].copy()),
              "num_items_in_batch": torch.tensor(float(mask.sum() if num_items is None else num_items))}
    if not on_policy:
        inputs["old_per_token_logps"] = torch.from_numpy(d["old"].copy())
    if beta != 0.0:
        inputs["ref_per_token_logps"] = torch.from_numpy(d["ref"].copy())
    loss = trl.GRPOTrainer._compute_loss(self, None, inputs)
    assert loss.dtype == torch.float64
    loss.backward()
    logged = {METRIC_NAMES[k]: v[-1] for k, v in self._metrics["train"].items() if k != "entropy"}
    return loss.item(), logged, new.grad.numpy()


def _ours_policy_loss(d, *, loss_type, level, epsilon_high, beta, bias, delta=None, on_policy=False, num_items=None):
    kwargs = dict(loss_type=loss_type, epsilon_low=0.2, epsilon_high=epsilon_high, beta=beta,
                  ref_logps=jnp.asarray(d["ref"]) if beta != 0.0 else None, importance_sampling_level=level,
                  max_completion_length=MAX_COMPLETION_LENGTH, kl_bias_correction=bias, delta=delta,
                  num_tokens=num_items)
    old = None if on_policy else jnp.asarray(d["old"])

    def loss_fn(new):
        return policy_loss(new, old, jnp.asarray(d["adv"]), jnp.asarray(d["mask"]), **kwargs)

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(d["new"]))
    assert loss.dtype == jnp.float64 and loss.shape == ()
    assert all(v.shape == () and v.dtype == jnp.float64 for v in metrics.values())
    return loss, metrics, grad


def _compare_policy(trl, what, **cfg):
    d = _policy_data()
    t_loss, t_metrics, t_grad = _trl_policy_loss(trl, d, **cfg)
    loss, metrics, grad = _ours_policy_loss(d, **cfg)
    assert set(metrics) == set(t_metrics), (what, sorted(metrics), sorted(t_metrics))
    errs = [_close(loss, t_loss, f"{what}: loss")]
    errs += [_close(metrics[k], t_metrics[k], f"{what}: metric {k}") for k in sorted(metrics)]
    errs.append(_close(grad, t_grad, f"{what}: d loss / d new_logps"))
    return max(errs), t_metrics


@pytest.mark.parity
@pytest.mark.parametrize("beta,bias", [(0.0, True), (0.04, True), (0.04, False)])
@pytest.mark.parametrize("epsilon_high", [0.2, 0.28])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", POLICY_LOSS_TYPES)
def test_policy_loss_matches_trl(trl, loss_type, level, epsilon_high, beta, bias):
    _, t_metrics = _compare_policy(trl, f"{loss_type}/{level}/eps_high={epsilon_high}/beta={beta}/bias={bias}",
                                   loss_type=loss_type, level=level, epsilon_high=epsilon_high, beta=beta, bias=bias)
    if loss_type in CLIPPED:  # the fixed inputs exercise the clipping on both sides
        assert t_metrics["clip_low_mean"] > 0 and t_metrics["clip_high_mean"] > 0


@pytest.mark.parity
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", CLIPPED)
def test_policy_loss_two_sided_clip_matches_trl(trl, loss_type, level):
    """δ caps ρ where A < 0 (INTELLECT-2); TRL's clip metrics then see the capped ratio."""
    _compare_policy(trl, f"{loss_type}/{level}/delta", loss_type=loss_type, level=level, epsilon_high=0.28, beta=0.04,
                    bias=True, delta=1.5)
    d = _policy_data()
    kw = dict(loss_type=loss_type, level=level, epsilon_high=0.28, beta=0.0, bias=True)
    assert not np.isclose(_ours_policy_loss(d, **kw)[0], _ours_policy_loss(d, delta=1.5, **kw)[0])


@pytest.mark.parity
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", POLICY_LOSS_TYPES)
def test_policy_loss_on_policy_matches_trl(trl, loss_type, level):
    """old_logps=None: TRL's μ = 1 path (old = new.detach()), every ratio 1 but gradients through it."""
    _compare_policy(trl, f"{loss_type}/{level}/on-policy", loss_type=loss_type, level=level, epsilon_high=0.28,
                    beta=0.04, bias=True, on_policy=True)


@pytest.mark.parity
@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_policy_loss_global_token_count_matches_trl(trl, loss_type):
    """The dapo-style normaliser is the generation batch's token count (`num_items_in_batch`)."""
    _compare_policy(trl, f"{loss_type}/num_tokens", loss_type=loss_type, level="token", epsilon_high=0.28, beta=0.04,
                    bias=True, num_items=97)


def test_policy_loss_defaults_and_invariants():
    d = _policy_data(seed=1)
    new, old, ref, adv, mask = (jnp.asarray(d[k]) for k in ("new", "old", "ref", "adv", "mask"))
    # dr_grpo's constant defaults to the padded width T.
    a = policy_loss(new, old, adv, mask, loss_type="dr_grpo")[0]
    b = policy_loss(new, old, adv, mask, loss_type="dr_grpo", max_completion_length=T)[0]
    assert a == b
    # dapo over one full batch equals bnpo; the token count defaults to the mask's.
    np.testing.assert_allclose(policy_loss(new, old, adv, mask, loss_type="dapo")[0],
                               policy_loss(new, old, adv, mask, loss_type="bnpo")[0], rtol=1e-14)
    # Policy = reference ⇒ every KL estimator is 0 (logged when a reference is given, even with beta 0).
    for est in ("k1", "k2", "k3"):
        _, metrics = policy_loss(new, old, adv, mask, ref_logps=new, kl_estimator=est)
        assert metrics["kl"] == 0.0
    assert "kl" not in policy_loss(new, old, adv, mask)[1]
    # k3 ≥ 0, and k1 is the log ratio.
    assert np.all(np.asarray(token_kl(new, ref)) >= 0)
    np.testing.assert_allclose(token_kl(new, ref, "k1"), new - ref, rtol=1e-14)
    # On-policy (old = new), the PPO-clip gradient is the plain policy gradient -A/L_i per token (grpo).
    g = jax.grad(lambda x: policy_loss(x, x, adv, mask, loss_type="grpo")[0])(new)
    want = -np.asarray(adv)[:, None] * d["mask"] / np.maximum(LENGTHS, 1)[:, None] / N
    np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-15)
    # beta ≠ 0 without a reference is a user error.
    with pytest.raises(ValueError, match="needs ref_logps"):
        policy_loss(new, old, adv, mask, beta=0.04)
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(new, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        policy_loss(new, old, adv, mask, importance_sampling_level="batch")


def test_policy_loss_jits_and_keeps_float32():
    """Every loss type traces under jit (no data-dependent Python; one program for all of them), and
    float32 in gives float32 out."""
    d = _policy_data(seed=2)
    args = [jnp.asarray(d[k], jnp.float32) for k in ("new", "old", "adv", "ref")]

    @jax.jit
    def every_type(n, o, a, r, m):
        return {f"{t}/{level}": policy_loss(n, o, a, m, loss_type=t, beta=0.04, ref_logps=r,
                                            importance_sampling_level=level)
                for t in POLICY_LOSS_TYPES for level in ("token", "sequence")}

    out = every_type(*args, jnp.asarray(d["mask"], bool))
    for loss, metrics in out.values():
        assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
        assert all(v.dtype == jnp.float32 for v in metrics.values())


# ------------------------------------------------------------------- sampler / trainer mismatch correction

IS_CASES = [(mode, hi, lo) for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
            for hi, lo in ((3.0, None), (1.3, 0.6))]
NS = 16  # 4 groups x 4 samples


def _is_data():
    """16 samples: fixed new / old log-probs and a sampler that differs from old per token and per sample
    (ratios on both sides of every bound), one NaN sampling log-prob (vLLM's None), varied lengths."""
    _, _, lengths = _completion_lists(NS)
    width = int(lengths.max())
    rng = np.random.default_rng(11)
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int64)
    new = -rng.uniform(0.05, 3.0, size=(NS, width))
    old = new + rng.normal(0.0, 0.2, size=(NS, width)) + rng.normal(0.0, 0.1, size=(NS, 1))
    sampler = old + rng.normal(0.0, 0.25, size=(NS, width)) + rng.normal(0.0, 0.3, size=(NS, 1))
    sampler[3, 0] = np.nan
    sampler = np.where(mask > 0, sampler, 0.0)  # TRL pads the sampler's log-probs with 0
    return dict(new=new, old=old, sampler=sampler, mask=mask, lengths=lengths)


def _trl_corrected(trl, d, *, mode, hi, lo, loss_type):
    """TRL's own path: `_generate_and_score_completions` with a vLLM-like `_generate` returning the sampler's
    log-probs (its IS ratio and sampling/* metrics), then `_compute_loss` on its output (loss, gradient)."""
    torch = trl.torch
    prompt_ids, completion_ids, _ = _completion_lists(NS)
    sampler_lists = [[None if np.isnan(x) else float(x) for x in d["sampler"][i, :n]] for i, n in
                     enumerate(d["lengths"])]
    common = dict(use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                  vllm_importance_sampling_clip_max=hi, vllm_importance_sampling_clip_min=lo)
    old = torch.from_numpy(d["old"].copy())
    gen = _generation_self(
        trl, _reward_table(False), NG, environment_factories=None, tools=None, environments=[], num_iterations=1,
        beta=0.0, ref_model=None, multi_objective_aggregation="sum_then_normalize", scale_rewards="group",
        _generate=lambda prompts: (prompt_ids, completion_ids, None, ["c"] * NS, sampler_lists, {}, None, None),
        _get_per_token_logps_and_entropies=lambda *a, **kw: (old, None, None), **common)
    inputs = trl.GRPOTrainer._generate_and_score_completions(gen, [{"prompt": f"p{i // NG}"} for i in range(NS)])
    new = torch.from_numpy(d["new"].copy()).requires_grad_(True)
    self = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda model, *a, **kw: (new, torch.zeros_like(new), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=0.0, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
        args=types.SimpleNamespace(use_bias_correction_kl=True, delta=None, sapo_temperature_pos=1.0,
                                   sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                                   vespo_lambda_neg=2.0, steps_per_generation=1),
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=MAX_COMPLETION_LENGTH, accelerator=_accelerator(torch), _entropy_bonus_enabled=False,
        _metrics=_metrics(), get_gamma_weights=trl.GRPOTrainer.get_gamma_weights, **common)
    loss = trl.GRPOTrainer._compute_loss(self, None, inputs)
    loss.backward()
    sampling = {k: v[-1] for k, v in gen._metrics["train"].items() if k.startswith("sampling/")}
    return loss.item(), sampling, new.grad.numpy(), inputs["advantages"].numpy()


def _ours_corrected(d, adv, *, mode, hi, lo, loss_type, sampler=None):
    def loss_fn(new):
        return policy_loss(new, jnp.asarray(d["old"]), jnp.asarray(adv), jnp.asarray(d["mask"]), loss_type=loss_type,
                           epsilon_high=0.28, max_completion_length=MAX_COMPLETION_LENGTH,
                           sampler_logps=jnp.asarray(d["sampler"] if sampler is None else sampler), is_mode=mode,
                           is_clip_max=hi, is_clip_min=lo)

    return jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(d["new"]))


# VESPO corrects token-level only (posttrain refuses the sequence modes, test below): those pairs are not parity cases
IS_LOSSES = ["grpo", "dapo", "dr_grpo", "vespo"]
IS_MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
IS_PARITY = [(loss, *case) for loss in IS_LOSSES for case in IS_CASES
             if not (loss == "vespo" and case[0].startswith("sequence"))]


@pytest.mark.parametrize("mode", [m for m in IS_MODES if m.startswith("sequence")])
def test_vespo_refuses_sequence_level_sampler_correction(mode):
    with pytest.raises(ValueError, match="token-level"):
        _ours_corrected(_is_data(), np.zeros(NS), mode=mode, hi=3.0, lo=None, loss_type="vespo")


@pytest.mark.parity
@pytest.mark.parametrize("loss_type,mode,hi,lo", IS_PARITY)
def test_sampler_correction_matches_trl(trl, mode, hi, lo, loss_type):
    """Loss, gradient and TRL's sampling/* metrics of each correction mode, both clip bounds, with padding
    and a NaN sampling log-prob (float64, <= 1e-6); the weights do cut or zero some tokens / samples."""
    d = _is_data()
    t_loss, t_sampling, t_grad, adv = _trl_corrected(trl, d, mode=mode, hi=hi, lo=lo, loss_type=loss_type)
    (loss, metrics), grad = _ours_corrected(d, adv, mode=mode, hi=hi, lo=lo, loss_type=loss_type)
    what = f"{loss_type}/{mode}/[{lo}, {hi}]"
    _close(loss, t_loss, f"{what}: loss")
    _close(grad, t_grad, f"{what}: d loss / d new_logps")
    assert len(t_sampling) == 5 and set(t_sampling) < set(metrics) and "sampling/mismatch_kl" in metrics
    for k, v in t_sampling.items():
        _close(metrics[k], v, f"{what}: {k}")
    w, _ = __import__("posttrain.losses", fromlist=["sampler_correction"]).sampler_correction(
        d["old"], d["sampler"], d["mask"], is_mode=mode, is_clip_max=hi, is_clip_min=lo)
    raw = np.exp(np.nan_to_num((d["old"] - d["sampler"]) * d["mask"]))
    raw = raw.prod(-1, keepdims=True) if mode.startswith("sequence") else raw
    assert np.any(np.asarray(w) != raw)  # the bounds bite on these inputs


@pytest.mark.parametrize("loss_type,mode", [(loss, mode) for loss, mode, _, lo in IS_PARITY if lo is None])
def test_sampler_equal_to_old_reduces_every_mode_to_the_uncorrected_loss(mode, loss_type):
    d = _is_data()
    adv = np.random.default_rng(2).normal(size=NS)
    (loss, metrics), grad = _ours_corrected(d, adv, mode=mode, hi=3.0, lo=0.5, loss_type=loss_type, sampler=d["old"])

    def plain(new):
        return policy_loss(new, jnp.asarray(d["old"]), jnp.asarray(adv), jnp.asarray(d["mask"]), loss_type=loss_type,
                           epsilon_high=0.28, max_completion_length=MAX_COMPLETION_LENGTH)

    (want, _), want_grad = jax.value_and_grad(plain, has_aux=True)(jnp.asarray(d["new"]))
    assert abs(float(loss) - float(want)) <= 1e-12
    np.testing.assert_allclose(grad, want_grad, atol=1e-12)
    assert float(metrics["sampling/mismatch_kl"]) == 0.0
    assert float(metrics["sampling/importance_sampling_ratio/max"]) == 1


def test_a_new_policy_loss_variant_is_one_registered_function():
    """The variants are a registry by name: a REINFORCE term (-ρ·A, the ratio 1 on-policy) registered with a
    normaliser is a `loss_type` of policy_loss and of the grpo section; its on-policy gradient is -A·m / Σm."""
    from posttrain.losses import policy as P
    from posttrain.trainers.grpo import GRPOSection

    assert set(POLICY_LOSS_TYPES) <= set(P.POLICY_LOSSES)

    @P.register_policy_loss("reinforce_test", normaliser="batch_tokens")
    def _reinforce(t):
        return -t.ratio * t.adv, lambda t: {"ratio_mean": t.global_mean(t.ratio)}

    try:
        _check_reinforce_test(GRPOSection)
    finally:
        P.POLICY_LOSSES.pop("reinforce_test")


def _check_reinforce_test(GRPOSection):
    d = _policy_data(seed=5)
    new, adv, mask = jnp.asarray(d["new"]), jnp.asarray(d["adv"]), jnp.asarray(d["mask"])
    loss, metrics = policy_loss(new, None, adv, mask, loss_type="reinforce_test")
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0)
    g = jax.grad(lambda x: policy_loss(x, None, adv, mask, loss_type="reinforce_test")[0])(new)
    np.testing.assert_allclose(g, -np.asarray(adv)[:, None] * d["mask"] / d["mask"].sum(), rtol=1e-12)
    assert GRPOSection(loss_type="reinforce_test").loss_type == "reinforce_test"
    with pytest.raises(Exception, match="grpo.loss_type must be one of"):
        GRPOSection(loss_type="nope")

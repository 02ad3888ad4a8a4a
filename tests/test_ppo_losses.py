"""PPO's pure functions against float64 NumPy references written here from the published formulas:
GAE (Schulman et al. 2016, as verl's `compute_gae_advantage_return` for token-level rewards),
masked whitening (TRL / verl `masked_whiten`), the clipped value loss (verl `compute_value_loss`),
dual-clip (verl `compute_policy_loss`, `clip_ratio_c`), KL-shaped rewards and the KL controller."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.losses import gae, masked_whiten, policy_loss, token_rewards, value_loss
from posttrain.rl.ppo import AdaptiveKL, make_ppo_loss

pytestmark = pytest.mark.usefixtures("x64")


def ref_gae(rewards, values, mask, gamma, lam):
    """verl's loop, float64: masked positions neither add a TD error nor break the recursion."""
    N, T = rewards.shape
    next_v, last = np.zeros(N), np.zeros(N)
    adv = np.zeros((N, T))
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * last
        next_v = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_v
        last = a * mask[:, t] + (1 - mask[:, t]) * last
        adv[:, t] = last
    return adv, adv + values


def ref_whiten(x, mask, shift_mean=True):
    sel = x[mask != 0]
    mean, var = sel.mean(), sel.var(ddof=1)
    out = (x - mean) / np.sqrt(var + 1e-8)
    return out if shift_mean else out + mean


def batch(seed, N=6, T=9, holes=False):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, N)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float64)
    if holes:  # observation tokens inside a completion (masked in the middle)
        mask[:, 1] = 0.0
        mask[:, 0] = 1.0
    return rng.normal(size=(N, T)), rng.normal(size=(N, T)), mask


@pytest.mark.parametrize("gamma, lam, holes", [(1.0, 0.95, False), (0.9, 0.8, False), (0.99, 0.95, True),
                                               (1.0, 1.0, False), (0.0, 0.5, False)])
def test_gae_equals_the_float64_reference(gamma, lam, holes):
    r, v, m = batch(int(gamma * 100 + lam * 10), holes=holes)
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam)
    ra, rr = ref_gae(r, v, m, gamma, lam)
    on = m != 0
    err = max(np.abs(np.asarray(adv) - ra)[on].max(), np.abs(np.asarray(ret) - rr)[on].max())
    print(f"gae max |Δ| = {err:.2e}")
    assert err <= 1e-6
    assert not np.asarray(adv)[~on].any() and not np.asarray(ret)[~on].any()  # masked positions carry nothing


def test_gae_ignores_what_masked_positions_hold():
    r, v, m = batch(3)
    r2, v2 = r.copy(), v.copy()
    r2[m == 0], v2[m == 0] = 1e3, -1e3
    a1, a2 = gae(r, v, m, gamma=0.9, lam=0.9)[0], gae(r2, v2, m, gamma=0.9, lam=0.9)[0]
    np.testing.assert_array_equal(np.asarray(a1), np.asarray(a2))


def test_gamma_lambda_one_gives_monte_carlo_returns():
    """γ = λ = 1: returns are the rewards-to-go (whatever the values) and advantages = returns − values."""
    r, v, m = batch(7)
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    togo = np.cumsum((r * m)[:, ::-1], axis=1)[:, ::-1] * m
    np.testing.assert_allclose(np.asarray(ret), togo, atol=1e-9)
    np.testing.assert_allclose(np.asarray(adv), (togo - v) * m, atol=1e-9)


def test_gae_in_float32_stays_close_to_float64():
    r, v, m = batch(11, N=32, T=64)
    adv = gae(r.astype(np.float32), v.astype(np.float32), m.astype(np.float32), gamma=1.0, lam=0.95)[0]
    assert np.asarray(adv).dtype == np.float32
    assert np.abs(np.asarray(adv, np.float64) - ref_gae(r, v, m, 1.0, 0.95)[0])[m != 0].max() <= 1e-4


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_equals_the_reference(shift_mean):
    x, _, m = batch(5)
    out = np.asarray(masked_whiten(x, m, shift_mean=shift_mean))
    err = np.abs(out - ref_whiten(x, m, shift_mean))[m != 0].max()
    print(f"whiten max |Δ| = {err:.2e}")
    assert err <= 1e-6 and not out[m == 0].any()
    if shift_mean:
        sel = out[m != 0]
        assert abs(sel.mean()) < 1e-9 and abs(sel.std(ddof=1) - 1) < 1e-6


@pytest.mark.parametrize("clip", [0.2, 0.05, None])
def test_value_loss_equals_the_reference(clip):
    rng = np.random.default_rng(2)
    v, old, ret = rng.normal(size=(3, 6, 8)) * [[[1.0]], [[0.3]], [[1.0]]]
    v = old + v * 0.3
    _, _, m = batch(2, N=6, T=8)
    loss, metrics = value_loss(v, old, ret, m, clip=clip)
    e1 = (v - ret) ** 2
    e2 = e1 if clip is None else (old + np.clip(v - old, -clip, clip) - ret) ** 2
    ref = 0.5 * (np.maximum(e1, e2) * m).sum() / m.sum()
    frac = ((e2 > e1) * m).sum() / m.sum()
    print(f"value_loss |Δ| = {abs(float(loss) - ref):.2e}, clipfrac {frac:.3f}")
    assert abs(float(loss) - ref) <= 1e-6 and abs(float(metrics["value_clipfrac"]) - frac) <= 1e-12
    if clip == 0.05:
        assert 0 < frac < 1  # the test exercises both branches
    # the gradient flows through the unclipped branch only where it is the larger error
    g = np.asarray(jax.grad(lambda x: value_loss(x, old, ret, m, clip=clip)[0])(v))
    pick = np.where(e1 >= e2, 1.0, 0.0) if clip is not None else 1.0
    np.testing.assert_allclose(g, (v - ret) * pick * m / m.sum(), atol=1e-9)


def test_dual_clip_is_policy_loss_delta():
    """verl's dual-clip (clip_ratio_c = c) equals policy_loss with the two-sided cap δ = c, gradients included."""
    rng = np.random.default_rng(4)
    N, T, eps, c = 8, 10, 0.2, 3.0
    old = rng.normal(size=(N, T))
    new = old + rng.normal(size=(N, T)) * 1.5  # ratios from ~0.01 to ~100: every branch
    adv = rng.normal(size=(N, T))
    _, _, m = batch(4, N=N, T=T)

    def verl(new):
        ratio = jnp.exp(new - old)
        l1, l2 = -adv * ratio, -adv * jnp.clip(ratio, 1 - eps, 1 + eps)
        clip1 = jnp.maximum(l1, l2)
        loss = jnp.where(adv < 0, jnp.minimum(-adv * c, clip1), clip1)
        return (loss * m).sum() / m.sum()

    ours = lambda x: policy_loss(x, old, adv, m, loss_type="bnpo", epsilon_low=eps, epsilon_high=eps,  # noqa: E731
                                 delta=c)[0]
    ratio = np.exp(new - old)
    assert ((ratio > c) & (adv < 0) & (m != 0)).any()  # the dual clip binds somewhere
    assert abs(float(ours(new)) - float(verl(new))) <= 1e-9
    np.testing.assert_allclose(np.asarray(jax.grad(ours)(new)), np.asarray(jax.grad(verl)(new)), atol=1e-9)
    assert abs(float(policy_loss(new, old, adv, m, loss_type="bnpo")[0]) - float(verl(new))) > 1e-3


def test_token_rewards_put_the_score_on_the_last_token():
    _, _, m = batch(9)
    kl = np.random.default_rng(9).normal(size=m.shape)
    scores = np.arange(m.shape[0], dtype=np.float64)
    out = np.asarray(token_rewards(scores, kl, m, 0.1))
    ref = -0.1 * kl * m
    for i in range(m.shape[0]):
        ref[i, int(m[i].sum()) - 1] += scores[i]
    np.testing.assert_allclose(out, ref, atol=1e-12)


def test_adaptive_kl_controller():
    up, down, big = AdaptiveKL(0.1, 0.05, 1000), AdaptiveKL(0.1, 0.05, 1000), AdaptiveKL(0.1, 0.05, 1000)
    up.update(0.06, 100)  # 20 % over target: β × (1 + 0.2 · 100/1000)
    down.update(0.04, 100)
    big.update(5.0, 100)  # the error is clipped at +20 %
    assert up.value == pytest.approx(0.1 * 1.02) and down.value == pytest.approx(0.1 * 0.98)
    assert big.value == pytest.approx(0.1 * 1.02)


def test_ppo_loss_on_policy():
    """Old log-probs and values from the model itself: ratio 1, no clipping, policy loss = −mean A, value
    loss = the plain squared error; the entropy bonus carries a gradient."""
    from posttrain.data.branches import group_row
    from posttrain.models import Transformer, preset
    from posttrain.models.heads import attach_score_head
    from posttrain.rl.critic import PolicyCritic, critic_values

    with jax.enable_x64(False):
        policy = Transformer(preset("tiny-student", vocab_size=263), rngs=nnx.Rngs(0))
        model = PolicyCritic(attach_score_head(policy, seed=1, std=1.0, drop_lm_head=False))  # shared critic
        graphdef, state = nnx.split(model)
        n, T = 2, 4
        row = group_row([5, 6, 7], [[8, 9, 10], [11, 12, 13, 14]], T)
        b = {k: jnp.asarray(v[None]) for k, v in row.items()}
        mask = np.asarray(b["score_w"]) != 0
        from posttrain.losses.logps import branch_logps

        old, values = jax.jit(lambda st: (branch_logps(nnx.merge(graphdef, st).policy, b, n)[0],
                                          critic_values(nnx.merge(graphdef, st), b)))(state)
        rng = np.random.default_rng(0)
        adv = jnp.asarray(rng.normal(size=(1, n * T)) * mask, jnp.float32)
        ret = values + jnp.asarray(rng.normal(size=(1, n * T)) * mask, jnp.float32)
        b.update(old_logps=old, old_values=values, advantages=adv, returns=ret)

        fs = [make_ppo_loss(num_generations=n, max_new_tokens=T, vf_coef=0.5, entropy_coef=e) for e in (0.0, 0.1)]

        @jax.jit
        def run(st):
            out = [jax.value_and_grad(lambda s, f=f: f(nnx.merge(graphdef, s), b), has_aux=True)(st) for f in fs]
            return out[0][0][1], [g["policy"]["embed"][...] for _, g in out]

        mt, (g0, g1) = run(state)
        assert float(mt["logp_mismatch_max"]) <= 1e-6 and float(mt["clip_region_mean"]) == 0
        assert abs(float(mt["policy_loss"]) + float(np.asarray(adv)[mask].mean())) <= 1e-6
        ref_vl = 0.5 * float((np.asarray(ret - values)[mask] ** 2).mean())
        assert abs(float(mt["value_loss"]) - ref_vl) <= 1e-6
        assert np.abs(g0 - g1).max() > 1e-6  # the entropy bonus changes the policy's gradient

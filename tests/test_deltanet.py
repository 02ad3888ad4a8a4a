"""The gated delta rule (posttrain/models/deltanet.py) against transformers' own torch forms, its two forms
against each other (outputs, final states and gradients), and its training memory linear in length."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from posttrain.models import deltanet


def _inputs(T, seed=0, B=2, H=3, Dk=8, Dv=12):
    r = np.random.default_rng(seed)
    q, k = r.normal(size=(B, T, H, Dk)), r.normal(size=(B, T, H, Dk))
    v = r.normal(size=(B, T, H, Dv))
    g = -np.log1p(np.exp(r.normal(size=(B, T, H)))) * 0.3  # log decays < 0, as -A softplus(a + dt_bias)
    beta = 1 / (1 + np.exp(-r.normal(size=(B, T, H))))
    state = r.normal(size=(B, H, Dk, Dv)) * 0.5
    return [x.astype(np.float32) for x in (q, k, v, g, beta, state)]


@pytest.mark.parity
@pytest.mark.parametrize("T", [1, 37, 150])  # 150: more than two 64-token chunks, the last one padded
def test_both_forms_equal_transformers(T):
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, state = _inputs(T)
    t = [torch.tensor(x) for x in (q, k, v, g, beta)]
    ref_o, ref_s = torch_chunk_gated_delta_rule(*t, initial_state=torch.tensor(state), output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    rec_o, rec_s = torch_recurrent_gated_delta_rule(*t, initial_state=torch.tensor(state), output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    assert float((ref_o - rec_o).abs().max()) <= 1e-4  # transformers' two forms agree with each other
    for form in (deltanet.chunked, deltanet.recurrent):
        o, s = jax.jit(form)(q, k, v, g, beta, state)
        np.testing.assert_allclose(np.asarray(o), ref_o.numpy(), atol=2e-5, rtol=0, err_msg=form.__name__)
        np.testing.assert_allclose(np.asarray(s), ref_s.numpy(), atol=2e-5, rtol=0, err_msg=form.__name__)


def test_chunked_gradients_equal_recurrent_and_padding_passes_the_state():
    q, k, v, g, beta, state = _inputs(70, seed=1)
    ct = np.random.default_rng(2).normal(size=v.shape).astype(np.float32)

    def loss(form):
        return lambda *a: jnp.sum(form(*a)[0] * ct) + jnp.sum(form(*a)[1])

    args = (q, k, v, g, beta, state)
    g1 = jax.jit(jax.grad(loss(deltanet.recurrent), argnums=tuple(range(6))))(*args)
    g2 = jax.jit(jax.grad(loss(lambda *a: deltanet.chunked(*a, chunk=16)), argnums=tuple(range(6))))(*args)
    for a, b in zip(g1, g2):
        assert float(jnp.abs(a).max()) > 1e-3
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=1e-5)
    # tokens with g = 0, beta = 0 (padding) leave the state as it was
    pad = np.arange(70)[None, :, None] >= 40
    gp, bp = (np.where(pad, 0.0, x).astype(np.float32) for x in (g, beta))
    _, s = deltanet.chunked(q, k, v, gp, bp, state)
    _, s40 = deltanet.chunked(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], state)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s40), atol=1e-5, rtol=0)


def _temp_bytes(T):
    f = jax.ShapeDtypeStruct
    shapes = [f((1, T, 4, 32), jnp.float32)] * 2 + [f((1, T, 4, 32), jnp.float32), f((1, T, 4), jnp.float32),
                                                   f((1, T, 4), jnp.float32)]
    step = jax.jit(jax.grad(lambda *a: jnp.sum(deltanet.chunked(*a)[0] ** 2), argnums=(0, 1, 2, 3, 4)))
    return step.lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def test_training_memory_is_linear_in_length():
    small, large = _temp_bytes(2048), _temp_bytes(8192)
    print(f"gated delta rule forward + backward temporaries: 2048 tokens {small / 2**20:.1f} MiB, "
          f"8192 tokens {large / 2**20:.1f} MiB ({large / small:.2f}x)")
    assert large < 5 * small


def _hf_layer(value_heads=4):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = Qwen3_5TextConfig(hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=value_heads,
                            linear_key_head_dim=16, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                            rms_norm_eps=1e-6, hidden_act="silu")
    torch.manual_seed(0)
    hf = Qwen3_5GatedDeltaNet(cfg, layer_idx=0).float()
    with torch.no_grad():
        for p in hf.parameters():  # the vectors away from their init (norm w != 1, dt_bias != 1)
            if p.ndim == 1:
                p.copy_(p + 0.3 * torch.randn_like(p))
    from flax import nnx

    ours = deltanet.GatedDeltaNet(48, key_heads=2, value_heads=value_heads, key_dim=16, value_dim=12, kernel=4,
                                  eps=1e-6, rngs=nnx.Rngs(0))
    t = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    for name in ("in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        getattr(ours, name)[...] = jnp.asarray(t[f"{name}.weight"].T)
    perm = deltanet.grouped_channels(2, value_heads, 16, 12)  # our channels grouped by key head
    ours.in_proj_qkv[...] = jnp.asarray(t["in_proj_qkv.weight"][perm].T)
    ours.conv[...] = jnp.asarray(t["conv1d.weight"][perm, 0])
    ours.dt_bias[...], ours.A_log[...], ours.norm[...] = (jnp.asarray(t[k]) for k in ("dt_bias", "A_log",
                                                                                       "norm.weight"))
    return hf, ours


def _close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    err = np.abs(got - want).max()
    assert err <= 1e-5 * (want.max() - want.min()), (err, want.max() - want.min())


@pytest.mark.parity
@pytest.mark.parametrize("value_heads", [2, 4])
def test_gated_deltanet_layer_equals_transformers(value_heads):
    """The whole layer against transformers' Qwen3_5GatedDeltaNet (its torch path), float32: a 37-token forward
    (two chunks), left padding (HF's padding mask) and a prefill of 30 tokens then 7 one-token steps carrying
    the state equal the full forward; max |difference| <= 1e-5 of the output range (outputs reach ~10 here)."""
    hf, ours = _hf_layer(value_heads)
    x = np.random.default_rng(1).normal(size=(2, 37, 48)).astype(np.float32)
    with torch.no_grad():
        want = hf(torch.from_numpy(x)).numpy()
    got, _ = jax.jit(lambda x: ours(x, chunk=16))(jnp.asarray(x))
    _close(np.asarray(got), want)

    mask = np.ones((2, 37), bool)
    mask[1, :9] = False  # row 1 left-padded by 9
    with torch.no_grad():
        want_pad = hf(torch.from_numpy(x), attention_mask=torch.from_numpy(mask.astype(np.int64))).numpy()
    got_pad, _ = ours(jnp.asarray(x), valid=jnp.asarray(mask), chunk=16)
    _close(np.asarray(got_pad)[:, 9:], want_pad[:, 9:])
    with torch.no_grad():  # the padded row's real tokens equal the row alone
        alone = hf(torch.from_numpy(x[1:, 9:])).numpy()
    _close(np.asarray(got_pad)[1, 9:], alone[0])

    y, state = ours(jnp.asarray(x[:, :30]), chunk=16)
    steps = [y]
    for t in range(30, 37):
        y, state = ours(jnp.asarray(x[:, t:t + 1]), state)
        steps.append(y)
    _close(np.asarray(jnp.concatenate(steps, 1)), want)


@pytest.mark.parametrize("C", [1, 8, 64])
def test_unit_lower_inverse_equals_the_matrix_inverse(C):
    """The chunk's (I + L)^-1 by doubling diagonal blocks (matrix products, no LAPACK call) = numpy's inverse in
    float64, on the kind of L the delta rule builds (beta K K^T decay, unit keys, some nearly parallel) and on a
    plain random one; a non-power-of-two chunk is refused."""
    r = np.random.default_rng(C)
    k = r.normal(size=(6, C, 16)) + 2.0 * r.normal(size=(6, 1, 16))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = np.cumsum(-r.uniform(0, 0.05, (6, C)), axis=-1)
    low = np.tril(r.uniform(0, 1, (6, C, 1)) * (k @ k.swapaxes(1, 2)) * np.exp(g[:, :, None] - g[:, None, :]), -1)
    plain = np.tril(r.normal(size=(2, C, C)), -1)
    eps = np.finfo(np.float64).eps
    inverse = jax.jit(deltanet.unit_lower_inverse)  # one program a shape (op by op: ~60 small compiles at C = 64)
    with jax.enable_x64(True):
        for L in (low, plain):
            A = np.eye(C) + L
            want = np.linalg.inv(A)
            got = np.asarray(inverse(jnp.asarray(L)))
            # The forward error of any backward-stable triangular inverse is bounded by ~ C * eps * cond(A) relative to
            # the inverse's size (Higham, Accuracy and Stability, ch. 8), so the bound follows each matrix's
            # conditioning, not one machine's rounding: the plain C = 64 matrices have cond ~ 1e9 and inverse entries
            # ~ 7e7, where a fixed 1e-9 relative bound failed on AVX-512 machines (0.085 against 0.066). A wrong inverse
            # is off by O(1) relative, > 1e4 times this bound even there.
            for a, w, g in zip(A, want, got):
                assert np.abs(g - w).max() <= C * eps * np.linalg.cond(a) * np.abs(w).max()
    with pytest.raises(ValueError, match="power of two"):
        deltanet.unit_lower_inverse(jnp.zeros((12, 12)))

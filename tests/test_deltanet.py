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

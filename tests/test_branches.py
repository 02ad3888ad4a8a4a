"""Prefix-shared rows (data/branches.py + losses/logps.py): per-token log-probs and the gradient of
their sum equal the unshared layout (prompt + each continuation as its own row), every family."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_models import FAMILIES

from posttrain.data.branches import pad_rows, shared_row, unshared_rows
from posttrain.errors import PosttrainError
from posttrain.losses.logps import branch_logps
from posttrain.models import attention as A
from posttrain.models import from_pretrained


def _groups(seed):
    """Two groups (rows) with different prompt and continuation lengths, k = 3."""
    r = np.random.default_rng(seed)
    return [(r.integers(3, 97, p).tolist(), [r.integers(3, 97, n).tolist() for n in ns])
            for p, ns in ((12, (9, 14, 5)), (7, (11, 3, 8)))]


def _shared_batch(groups):
    return {k: jnp.asarray(v) for k, v in pad_rows([shared_row(p, c) for p, c in groups], 48, 32).items()}


def _unshared_batch(groups):
    return {k: jnp.asarray(v) for k, v in pad_rows([r for p, c in groups for r in unshared_rows(p, c)], 32, 16).items()}


def _use(path, monkeypatch):
    if path == "blockwise":  # 8-token tiles on these short rows
        monkeypatch.setattr(A, "DENSE_MAX", 4)
        monkeypatch.setattr(A, "BLOCK", 8)
    else:
        monkeypatch.setattr(A, "DENSE_MAX", 1 << 20)


LOGPS_CASES = [(f, "blockwise") for f in FAMILIES] + [("llama", "dense"), ("gemma2", "dense")]


@pytest.mark.parametrize("family,path", LOGPS_CASES)
def test_shared_logps_equal_unshared(hf_checkpoints, family, path, monkeypatch):
    _use(path, monkeypatch)
    model = from_pretrained(hf_checkpoints[family])
    groups = _groups(0)
    tok_s, sums_s, counts_s = branch_logps(model, _shared_batch(groups), 3)
    tok_u, sums_u, counts_u = branch_logps(model, _unshared_batch(groups), 1)
    k = 3
    np.testing.assert_allclose(np.asarray(sums_s).reshape(-1), np.asarray(sums_u)[:, 0], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(counts_s).reshape(-1), np.asarray(counts_u)[:, 0])
    for g, (_, conts) in enumerate(groups):  # token by token
        off = 0
        for i, c in enumerate(conts):
            np.testing.assert_allclose(np.asarray(tok_s)[g, off:off + len(c)],
                                       np.asarray(tok_u)[g * k + i, :len(c)], atol=1e-5, rtol=0)
            off += len(c)


# llama (plain) and gemma3 (sliding-window layers) through the blockwise custom VJP; the dense
# path's gradient is JAX autodiff of the reference (its log-probs are checked above).
@pytest.mark.parametrize("family,path", [("llama", "blockwise"), ("gemma3", "blockwise")])
def test_shared_gradient_equals_unshared(hf_checkpoints, family, path, monkeypatch):
    """d/dweights of a per-branch weighted token mean of the log-probs (DPO / GRPO shaped objective).

    A token mean, not a raw sum: with the raw sum over ~60 tokens, embedding-gradient entries of
    magnitude ~2 differ by up to 1.05e-5 between the layouts (float32 accumulation order, relative
    5e-6; measured for gemma3), which is float32 round-off, not a layout difference."""
    _use(path, monkeypatch)
    graphdef, params = nnx.split(from_pretrained(hf_checkpoints[family]))
    groups = _groups(1)
    n_tokens = sum(len(c) for _, conts in groups for c in conts)
    coef = jnp.asarray([[1.0, -0.5, 2.0], [0.3, 1.5, -1.0]]) / n_tokens
    shared, unshared = _shared_batch(groups), _unshared_batch(groups)

    def f_shared(p):
        return jnp.sum(branch_logps(nnx.merge(graphdef, p), shared, 3)[1] * coef)

    def f_unshared(p):
        return jnp.sum(branch_logps(nnx.merge(graphdef, p), unshared, 1)[1][:, 0] * coef.reshape(-1))

    # Jitted (fresh closures, so traced here with this test's attention path): op by op, the gradient
    # compiled 475 small programs (53 s of compilation in the one run measured).
    v1, g1 = jax.jit(jax.value_and_grad(f_shared))(params)
    v2, g2 = jax.jit(jax.value_and_grad(f_unshared))(params)
    np.testing.assert_allclose(v1, v2, atol=1e-4, rtol=0)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_row_layout():
    r = shared_row([5, 6, 7], [[8, 9], [10]])
    np.testing.assert_array_equal(r["tokens"], [5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(r["positions"], [0, 1, 2, 3, 4, 3])
    np.testing.assert_array_equal(r["branch_ids"], [0, 0, 0, 1, 1, 2])
    np.testing.assert_array_equal(r["score_src"], [2, 3, 2])  # both branches' first tokens from the prompt's end
    np.testing.assert_array_equal(r["score_tgt"], [8, 9, 10])
    np.testing.assert_array_equal(r["score_branch"], [1, 1, 2])


def test_bad_rows():
    with pytest.raises(PosttrainError, match="prompt is empty"):
        shared_row([], [[1]])
    with pytest.raises(PosttrainError, match="at least one token"):
        shared_row([1], [[2], []])
    with pytest.raises(PosttrainError, match="exceed"):
        pad_rows([shared_row([1, 2], [[3, 4, 5]])], 4, 8)

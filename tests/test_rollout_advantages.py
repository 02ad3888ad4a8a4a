"""rl/rollout.py's `_advantages`: op by op on a CPU (the parity tests' path), one jitted program on an accelerator.
The jitted program must give the estimators' values (checked here on a CPU by making the rollout believe it runs on
an accelerator), and an estimator that a jit cannot trace must still run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.losses import advantages as A
from posttrain.rl import rollout as R


def _rewards():
    rng = np.random.default_rng(3)
    total = rng.normal(size=(24, 1))
    total[5, 0] = np.nan  # an unscorable sample
    total[8:12, 0] = 0.5  # a group without signal
    return total, rng.integers(1, 40, size=24)


@pytest.mark.parametrize("name", ["group", "rloo", "reinforce_pp"])
def test_jitted_estimator_equals_op_by_op(monkeypatch, name):
    total, lengths = _rewards()
    eager = np.asarray(A.estimate_advantages(name, total, None, 4, scale="group", lengths=lengths))
    assert R._advantages(name, total, 4, "group", lengths).tolist() == eager.tolist()  # a CPU: the same call
    before = R._jitted_estimator.cache_info().currsize
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    fast = R._advantages(name, total, 4, "group", lengths)
    assert R._jitted_estimator.cache_info().currsize == before + 1  # the jitted path ran
    assert np.isfinite(eager).sum() >= 20 and np.abs(eager).max() > 0.1
    np.testing.assert_allclose(fast, eager, rtol=1e-6, atol=1e-6)


def test_estimator_with_python_control_flow_runs_op_by_op(monkeypatch):
    def flow(r, weights, n, *, scale, lengths):  # a float() of a traced value: no jit can trace it
        r = jnp.nan_to_num(jnp.asarray(r)[:, 0])
        return r - r.mean() if float(r.sum()) > 0 else r

    monkeypatch.setitem(A.ESTIMATORS, "pyflow", flow)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    total, lengths = _rewards()
    total = np.abs(total)
    want = np.nan_to_num(total[:, 0]) - np.nan_to_num(total[:, 0]).mean()
    np.testing.assert_allclose(R._advantages("pyflow", total, 4, "group", lengths), want, rtol=1e-6, atol=1e-6)
    assert ("pyflow", 4, "group") in R._UNTRACEABLE  # remembered: the next rollout does not try the jit again
    monkeypatch.setattr(R, "_jitted_estimator", None)  # calling it would raise
    np.testing.assert_allclose(R._advantages("pyflow", total, 4, "group", lengths), want, rtol=1e-6, atol=1e-6)
    R._UNTRACEABLE.discard(("pyflow", 4, "group"))

"""posttrain.plan's step terms: remat adds gradients to activations, and a device's memory caps the total."""

from posttrain.models import preset
from posttrain.plan import format_plan, plan

CFG = preset("demo-tiny")


def _plan(**kw):
    return plan(CFG, batch=2, seq_len=64, mesh_shape={"data": 1}, preset="dp", **kw)


def test_remat_adds_gradients_to_activations():
    """With remat every layer's backward recomputes that layer's activations beside the gradients written so far,
    so the two add; without it the larger counts (the backward frees one as it writes the other)."""
    p, r = _plan(), _plan(remat=True)
    base = p["parameters"] + p["optimizer"] + p["kv_cache"]
    assert p["total"] == base + max(p["gradients"], p["activations"])
    assert r["total"] == base + r["gradients"] + r["activations"]
    assert r["activations"] < p["activations"]


def test_device_memory_caps_the_total():
    """A step that needs more than the device holds is fitted by XLA's rematerialisation: total = the device's
    memory, demand = what it would need, fitted = True; a step that fits is unchanged."""
    free = _plan()
    assert not free["fitted"] and free["demand"] == free["total"]
    roomy = _plan(device_bytes=free["demand"] + 1)
    assert not roomy["fitted"] and roomy["total"] == free["total"]
    small = free["demand"] // 2
    tight = _plan(device_bytes=small)
    assert tight["fitted"] and tight["total"] == small and tight["demand"] == free["demand"]
    text = format_plan(tight, small)
    assert "XLA rematerialises" in text and "WARNING" in text


def test_remat_counts_the_attention_backward(monkeypatch):
    """With remat on the blockwise path (rows longer than the dense limit) one layer's attention backward is live
    beside its recomputed set: float32 dq, dk, dv over the row and two [rows, N, tile, tile] tiles; the dense path
    (short rows) and the step without remat have no such term."""
    import jax.numpy as jnp

    import posttrain.plan as P
    from posttrain.models.attention import TPU_TILE

    T, rows = 1024, 2
    long = plan(CFG, batch=rows, seq_len=T, mesh_shape={"data": 1}, preset="dp", remat=True)
    plain = plan(CFG, batch=rows, seq_len=T, mesh_shape={"data": 1}, preset="dp")
    short = _plan(remat=True)  # 64 tokens: the dense path
    K, H, N = CFG.layer_kv_heads(0), CFG.layer_head_dim(0), CFG.num_heads
    tile = min(TPU_TILE, T)
    expected = rows * T * (N + 2 * K) * H * 4 + 2 * rows * N * tile * tile * jnp.dtype(CFG.dtype).itemsize
    assert P._attention_backward_bytes(CFG, 0, rows, T, 1) == expected
    monkeypatch.setattr(P, "_attention_backward_bytes", lambda *a: 0)
    without = plan(CFG, batch=rows, seq_len=T, mesh_shape={"data": 1}, preset="dp", remat=True)
    assert long["activations"] - without["activations"] == expected
    assert plan(CFG, batch=rows, seq_len=T, mesh_shape={"data": 1}, preset="dp")["activations"] == \
        plain["activations"]
    assert _plan(remat=True)["activations"] == short["activations"]

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

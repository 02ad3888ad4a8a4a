"""Metric sinks (JSONL, TensorBoard, Prometheus), the profiler window, FLOPs and memory figures."""

import json
import math
import struct
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.config import MetricsSection
from posttrain.models import ModelConfig
from posttrain.train import metrics as M


def test_jsonl_sink_appends_one_parseable_line_per_write(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    sink = M.JsonlSink(path)
    sink.write(1, {"loss": 2.5, "lr": np.float32(1e-3)})
    sink.write(2, {"loss": 2.25})
    sink.close()
    sink = M.JsonlSink(path)  # a resumed run appends to the same file
    sink.write(3, {"loss": float("nan")})
    sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["loss"] == 2.5 and rows[0]["lr"] == pytest.approx(1e-3)
    assert rows[1] == {"step": 2, "loss": 2.25}
    assert math.isnan(rows[2]["loss"])


def _read_tfrecords(path):
    """Decode a TFRecord file: [u64 length][u32 crc][data][u32 crc] per record."""
    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        out.append(data[i + 12:i + 12 + n])
        i += 12 + n + 4
    return out


def test_tensorboard_sink_writes_scalars(tmp_path):
    from tensorboardX.proto import event_pb2

    sink = M.TensorBoardSink(tmp_path / "tb")
    sink.write(5, {"loss": 1.25, "train/acc": 0.5})
    sink.write(6, {"loss": 1.0, "train/acc": 0.75})
    sink.close()
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1
    got = {}
    for rec in _read_tfrecords(files[0]):
        ev = event_pb2.Event.FromString(rec)
        for v in ev.summary.value:
            got[(v.tag, ev.step)] = v.simple_value
    assert got == {("loss", 5): 1.25, ("train/acc", 5): 0.5, ("loss", 6): 1.0, ("train/acc", 6): 0.75}


def _scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_prometheus_sink_serves_gauges_and_closes():
    sink = M.PrometheusSink("127.0.0.1", 0)
    assert sink.port > 0
    sink.write(7, {"loss": 1.5, "grad-norm": 0.25})
    values = _scrape(sink.port)
    assert values["posttrain_loss"] == 1.5
    assert values["posttrain_step"] == 7
    assert values["posttrain_grad_norm"] == 0.25  # '-' is not allowed in Prometheus names
    sink.write(8, {"loss": 1.0})
    values = _scrape(sink.port)
    assert values["posttrain_loss"] == 1.0 and values["posttrain_step"] == 8
    port = sink.port
    sink.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    # A second sink in the same process registers the same gauge names on its own registry.
    second = M.PrometheusSink("127.0.0.1", 0)
    try:
        second.write(1, {"loss": 3.0})
        values = _scrape(second.port)
        assert values["posttrain_loss"] == 3.0 and values["posttrain_step"] == 1
    finally:
        second.close()


def test_make_sinks(tmp_path):
    section = MetricsSection(sinks=("console", "jsonl", "tensorboard"))
    sinks = M.make_sinks(section, tmp_path)
    assert [type(s) for s in sinks] == [M.JsonlSink, M.TensorBoardSink]
    for s in sinks:
        s.write(1, {"loss": 1.0})
        s.close()
    assert (tmp_path / "metrics.jsonl").exists()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert M.make_sinks(section, tmp_path / "other", is_main_process=False) == []
    assert not (tmp_path / "other").exists()


def _run_steps(profiler, steps):
    f = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((8, 8))
    for step in range(1, steps + 1):
        profiler.before_step(step)
        x = f(x)
        profiler.after_step(step, x)
        # The window is steps 2..3: open exactly during them.
        assert profiler.active == (profiler.start > 0 and step == 2)
    profiler.close()


def test_profiler_traces_window_only_when_enabled(tmp_path):
    _run_steps(M.Profiler(2, 2, tmp_path / "on"), steps=5)
    assert list((tmp_path / "on").rglob("*.xplane.pb"))
    _run_steps(M.Profiler(0, 2, tmp_path / "off"), steps=5)
    assert not (tmp_path / "off").exists() or not list((tmp_path / "off").rglob("*.xplane.pb"))
    # Training that ends inside the window: close() stops the trace, and a new one can start.
    p = M.Profiler(1, 10, tmp_path / "short")
    p.before_step(1)
    assert p.active
    p.close()
    assert not p.active and list((tmp_path / "short").rglob("*.xplane.pb"))


def test_model_flops_per_token_by_hand():
    cfg = ModelConfig(vocab_size=32, embed_dim=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                      mlp_dim=16)
    # Per layer: q 8*2*4=64, k 32, v 32, o 2*4*8=64, gate/up/down 3*8*16=384 -> 576 weights.
    # Two layers 1152 + LM head 8*32=256 -> 1408 matmul weights -> 2816 FLOPs.
    # Attention at seq 10: 2 (QK^T, PV) * 2 * heads 2 * head_dim 4 * 10 keys * 2 layers = 640.
    assert M.model_flops_per_token(cfg, 10, training=False) == 2816 + 640
    assert M.model_flops_per_token(cfg, 10) == 3 * (2816 + 640)
    assert M.mfu(100.0, 3456.0, 3456.0 * 400, num_devices=2) == pytest.approx(0.125)


def test_peak_flops():
    measured = M.measure_peak_flops(512, 3)
    assert measured > 1e9
    assert M.measure_peak_flops(512, 3) == measured  # cached, not measured again
    assert M.peak_flops(MetricsSection(peak_flops=1e15)) == 1e15


def test_memory_stats_on_cpu():
    stats = M.memory_stats()
    if jax.default_backend() == "cpu":
        assert set(stats) == {"host_rss_bytes"} and stats["host_rss_bytes"] > 10 * 2**20
    else:
        assert stats["device_peak_bytes"] >= stats["device_bytes_in_use"] >= 0


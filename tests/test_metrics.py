"""Metric sinks (JSONL, TensorBoard, Prometheus), the profiler window, FLOPs and memory figures."""

import json
import math
import os
import struct
import time
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.config import MetricsSection
from posttrain.models import ModelConfig
from posttrain.plan import flops_per_token
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
    assert flops_per_token(cfg, 10, training=False) == 2816 + 640
    assert flops_per_token(cfg, 10) == 3 * (2816 + 640)
    assert M.mfu(100.0, 3456.0, 3456.0 * 400, num_devices=2) == pytest.approx(0.125)


def test_moe_flops_count_the_routed_experts_not_the_dense_width():
    """The MFU cost model is plan's per-layer one: a sparse layer runs its top-k experts and the router
    instead of the dense MLP (mlp_dim); a dense layer (dense_layers) keeps the dense MLP."""
    cfg = ModelConfig(vocab_size=32, embed_dim=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                      mlp_dim=16, num_experts=4, experts_per_token=2, expert_mlp_dim=6, dense_layers=(1,))
    # Layer 0 (sparse): projections 192 + top-2 experts 2*3*8*6=288 + router 8*4=32 -> 512 weights.
    # Layer 1 (dense): 192 + 384 = 576. LM head 256. Matmuls 2 * 1344 = 2688; attention at seq 10: 640.
    assert flops_per_token(cfg, 10, training=False) == 2688 + 640


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



# ----------------------------------------------------------------------------- Weights & Biases


def _wandb_records(path):
    """The protobuf records of a `.wandb` file (wandb's LevelDB-style log): a 7-byte header
    (':W&B', magic, version), then 32 KiB blocks of chunks [u32 crc][u16 length][u8 type][data],
    type 1 = a whole record, 2/3/4 = its first/middle/last piece; a block's tail under 7 bytes is padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, pos, block, parts = [], 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding at the end of the file
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            parts = b""
        parts += chunk
        if kind in (1, 4):
            out.append(pb.Record.FromString(parts))
    return out


def _finished_wandb_run(run_dir, timeout=60.0):
    """The records of the one offline run under `run_dir`, once its exit record is on disk: `finish()`
    returns when wandb-core has handled the exit, and the core writes the file's last block when it
    closes the stream, a moment later (at the latest when the process exits)."""
    deadline = time.monotonic() + timeout
    while True:
        files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
        assert len(files) == 1, files  # one run, written inside the run folder
        records = _wandb_records(files[0])
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb in offline mode with its settings and caches under tmp_path (nothing in $HOME, no network)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    for var in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_DIR", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    yield
    import wandb

    wandb.teardown()  # wandb keeps process-wide settings from the environment it first saw: start afresh


def test_wandb_sink_offline_logs_scalars_config_and_name(tmp_path, wandb_offline):
    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("train:\n  steps: 7\n  seed: 3\nrun_dir: my-run\n")
    section = MetricsSection(sinks=("console", "jsonl", "wandb"), wandb_project="proj-x")
    sinks = M.make_sinks(section, run_dir)
    assert [type(s) for s in sinks] == [M.JsonlSink, M.WandbSink]
    wb = sinks[1]
    wb.write(1, {"loss": 2.5, "lr": np.float32(0.125)})
    wb.write(2, {"loss": 1.25, "lr": jnp.asarray(0.0625)})
    wb.write(2, {"eval_loss": 3.5})  # an evaluation at the same step joins that step's row
    wb.write(4, {"loss": 0.75})
    for s in sinks:
        s.close()
    wb.close()  # closing twice is harmless

    records = _finished_wandb_run(run_dir)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert runs and runs[0].display_name == "my-run" and runs[0].project == "proj-x"
    config = {u.key or "/".join(u.nested_key): json.loads(u.value_json) for r in runs for u in r.config.update}
    config.pop("_wandb", None)
    assert config == {"train": {"steps": 7, "seed": 3}, "run_dir": "my-run"}
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            row = {k: v for k, v in items.items() if not k.startswith("_")}  # _step, _runtime, _timestamp
            history.setdefault(r.history.step.num, {}).update(row)
    assert history == {1: {"loss": 2.5, "lr": 0.125}, 2: {"loss": 1.25, "lr": 0.0625, "eval_loss": 3.5},
                       4: {"loss": 0.75}}
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished cleanly


def test_wandb_sink_takes_an_explicit_config_and_name(tmp_path, wandb_offline):
    sink = M.WandbSink(tmp_path / "r", project="p", name="custom", config={"optim": {"lr": 0.5}})
    sink.write(3, {"reward": 1.0})
    sink.close()
    runs = [r.run for r in _finished_wandb_run(tmp_path / "r") if r.WhichOneof("record_type") == "run"]
    assert runs[0].display_name == "custom"
    assert {u.key or "/".join(u.nested_key): json.loads(u.value_json)
            for u in runs[0].config.update}["optim"] == {"lr": 0.5}


def test_wandb_not_installed_is_a_config_error(tmp_path, monkeypatch, capsys):
    import sys

    from posttrain.config import SFTConfig, load
    from posttrain.errors import PosttrainError

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, find_spec finds nothing
    with pytest.raises(PosttrainError, match=r"posttrain\[wandb\]"):
        load(SFTConfig, None, ["model.preset=tiny", "data.train=t", "metrics.sinks=[jsonl, wandb]"])
    with pytest.raises(PosttrainError, match=r"posttrain\[wandb\]"):
        M.WandbSink(tmp_path)
    assert MetricsSection(sinks=("jsonl",)).sinks == ("jsonl",)  # not asked for: no error
    # The CLI: one line, exit 2, nothing written (the check runs when the config is read).
    from posttrain.cli import main

    config = os.path.join(os.path.dirname(__file__), "..", "configs", "sft_tiny.yaml")
    rc = main(["sft", "--config", config, f"run_dir={tmp_path / 'run'}", "metrics.sinks=[wandb]"])
    assert rc == 2 and "pip install 'posttrain[wandb]'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_wandb_that_cannot_start_is_a_clear_error_and_closes_the_other_sinks(tmp_path, wandb_offline, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")  # online without any API key: wandb refuses before any network
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc credentials either
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    from posttrain.errors import PosttrainError

    section = MetricsSection(sinks=("jsonl", "prometheus", "wandb"), prometheus_port=0)
    opened = []
    real = M.PrometheusSink.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        opened.append(self)

    monkeypatch.setattr(M.PrometheusSink, "__init__", spy)
    with pytest.raises(PosttrainError, match="WANDB_MODE=offline"):
        M.make_sinks(section, tmp_path / "run")
    assert len(opened) == 1 and opened[0]._server is None  # the exporter was shut down, its port released

"""Operations during a real SFT run: Prometheus scraped mid-run, TensorBoard scalars, profiler trace, MFU."""

import glob
import json
import os
import urllib.request
from pathlib import Path

from posttrain import config as C
from posttrain.train.loop import Hook

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "sft_prompt_completion.jsonl")


def test_sinks_profiler_and_mfu_during_a_run(tmp_path, monkeypatch):
    """Prometheus scraped at step 4, TensorBoard loss at every step, a profiler trace, and the MFU of the run's
    throughput against a configured peak."""
    import posttrain.train.trainer as engine
    import posttrain.trainers.sft as sft_mod

    run_dir = str(tmp_path / "run")
    cfg = C.load(C.SFTConfig, None, [
        "model.preset=demo-tiny", f"data.train={DATA}", "data.max_length=32", "train.steps=6",
        "train.batch_size=4", "train.log_every=1", f"run_dir={run_dir}",
        "metrics.sinks=[jsonl,tensorboard,prometheus]", "metrics.prometheus_port=0",
        "profile.start_step=2", "profile.num_steps=2", "metrics.peak_flops=1e12"])
    sinks, scraped = [], {}
    real_make, real_loop = engine.make_sinks, engine.train_loop

    def make(*a, **kw):
        sinks.extend(real_make(*a, **kw))
        return sinks

    def loop(*a, hooks=(), **kw):
        def scrape(step, state, metrics):
            if step == 4:  # mid-run: the exporter serves the metrics of step 4
                port = next(s.port for s in sinks if hasattr(s, "port"))
                scraped["text"] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

        return real_loop(*a, hooks=list(hooks) + [Hook(scrape, 1)], **kw)

    monkeypatch.setattr(engine, "make_sinks", make)
    monkeypatch.setattr(engine, "train_loop", loop)
    result = sft_mod.SFTTrainer(cfg, progress=False).train()

    text = scraped["text"]
    assert "posttrain_step 4.0" in text
    for name in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "step_time_s", "host_rss_bytes"):
        assert f"posttrain_{name} " in text, name
    events = glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))
    assert events
    from tensorboardX.proto import event_pb2
    from test_metrics import _read_tfrecords

    loss_steps = [ev.step for f in events for ev in map(event_pb2.Event.FromString, _read_tfrecords(Path(f)))
                  if any(v.tag == "loss" for v in ev.summary.value)]
    assert loss_steps == [1, 2, 3, 4, 5, 6]
    assert glob.glob(os.path.join(run_dir, "profile", "**", "*.xplane.pb"), recursive=True)
    records = [json.loads(ln) for ln in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    # MFU = tokens/s x training FLOPs per token / the configured peak (1e12 FLOP/s, one device), and those FLOPs lie
    # between 6 N (the matmul weights N, LM head included: forward 2 N, backward 4 N) and 6 N plus the attention
    # scores and values (12 L T D at T = data.max_length, Kaplan et al. 2020)
    from posttrain.models import preset

    mc = preset("demo-tiny")
    d, t, L = mc.embed_dim, 32, mc.num_layers
    n = L * (d * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + mc.num_heads * mc.head_dim * d
             + 3 * d * mc.mlp_dim) + d * mc.vocab_size
    assert result["tokens_per_s"] > 0
    fpt = result["mfu"] * 1e12 / result["tokens_per_s"]
    assert 6 * n <= fpt * (1 + 1e-6) and fpt <= (6 * n + 12 * L * t * d) * (1 + 1e-6), (fpt, 6 * n)

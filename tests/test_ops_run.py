"""Operations during a real SFT run: Prometheus scraped mid-run, TensorBoard scalars, profiler trace, MFU."""

import glob
import json
import os
import urllib.request
from pathlib import Path

from posttrain import config as C
from posttrain.train.loop import FnHook

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "sft_prompt_completion.jsonl")


def test_sinks_profiler_and_mfu_during_a_run(tmp_path, monkeypatch):
    import posttrain.train.lifecycle as lifecycle
    import posttrain.trainers.sft as sft_mod

    run_dir = str(tmp_path / "run")
    cfg = C.load(C.SFTConfig, None, [
        "model.preset=demo-tiny", f"data.train={DATA}", "data.max_length=32", "train.steps=6",
        "train.batch_size=4", "train.log_every=1", f"run_dir={run_dir}",
        "metrics.sinks=[jsonl,tensorboard,prometheus]", "metrics.prometheus_port=0",
        "profile.start_step=2", "profile.num_steps=2"])
    sinks, scraped = [], {}
    real_make, real_loop = lifecycle.make_sinks, lifecycle.train_loop

    def make(*a, **kw):
        sinks.extend(real_make(*a, **kw))
        return sinks

    def loop(*a, hooks=(), **kw):
        def scrape(step, state, metrics):
            if step == 4:  # mid-run: the exporter serves the metrics of step 4
                port = next(s.port for s in sinks if hasattr(s, "port"))
                scraped["text"] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

        return real_loop(*a, hooks=list(hooks) + [FnHook(1, scrape)], **kw)

    monkeypatch.setattr(lifecycle, "make_sinks", make)
    monkeypatch.setattr(lifecycle, "train_loop", loop)
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
    assert 0 < result["mfu"] < 1.5 and result["tokens_per_s"] > 0

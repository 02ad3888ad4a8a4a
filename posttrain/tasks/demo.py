"""`posttrain demo`: the main job on a built-in task, from scratch, on a CPU in a few minutes.

SFT of a tiny Llama-architecture model (byte tokenizer, random init) on two-digit addition
(`tasks/addition.py`, prompt/completion rows generated from a seed): held-out exact-match
accuracy (greedy) before and after, then the run exported as a Hugging Face folder that
transformers loads. No downloads.
"""

from __future__ import annotations

import os
import shutil
import time

from posttrain import config as C
from posttrain.tasks import addition
from posttrain.trainers.sft import SFTTrainer, accuracy, export_run


def demo_config(out_dir: str, steps: int = 1500) -> "C.SFTConfig":
    data = os.path.join(out_dir, "data")
    return C.from_dict(C.SFTConfig, {
        "model": {"preset": "demo-tiny", "seed": 0},
        "data": {"train": os.path.join(data, "train.jsonl"), "eval": os.path.join(data, "eval.jsonl"),
                 "max_length": 16, "seed": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 100, "schedule": "cosine", "min_lr_ratio": 0.05,
                  "weight_decay": 0.01},
        "train": {"steps": steps, "batch_size": 64, "log_every": 100},
        "run_dir": os.path.join(out_dir, "run"),
    }, where="demo")


def run(out_dir: str = "runs/demo", steps: int = 1500, progress: bool = True) -> dict:
    t0 = time.perf_counter()
    train, evals = addition.make_pairs(digits=2, seed=0, n_eval=200)
    addition.write_jsonl(train, os.path.join(out_dir, "data", "train.jsonl"))
    addition.write_jsonl(evals, os.path.join(out_dir, "data", "eval.jsonl"))
    cfg = demo_config(out_dir, steps)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # the demo's own folder: start fresh each time
    trainer = SFTTrainer(cfg, progress=progress)
    pairs = [(r["prompt"], r["completion"]) for r in evals]
    before = accuracy(trainer.model, trainer.tokenizer, pairs)
    print(f"[demo] two-digit addition, {len(train)} training rows, {len(pairs)} held-out questions")
    print(f"[demo] held-out exact-match accuracy before training: {before:.1%}")
    result = trainer.train()
    after = accuracy(trainer.model, trainer.tokenizer, pairs)
    print(f"[demo] held-out exact-match accuracy after {steps} SFT steps: {after:.1%} "
          f"(loss {result['first_loss']:.3f} -> {result['loss']:.3f})")
    hf_dir = export_run(cfg.run_dir, os.path.join(out_dir, "hf"))
    examples = [p for p, _ in pairs[:3]]
    from posttrain.generate import Sampler, SamplingParams
    from posttrain.models import from_pretrained

    model = from_pretrained(hf_dir)
    tok = trainer.tokenizer
    out = Sampler(model, max_len=64).generate([tok.encode(p) for p in examples],
                                              SamplingParams(max_new_tokens=6, temperature=0.0, stop_ids=tok.eos_ids))
    shown = ", ".join(f"{p}{t}" for p, t in zip(examples, out.texts(tok)))
    print(f"[demo] exported a Hugging Face folder to {hf_dir}; reloaded it and asked: {shown}")
    seconds = time.perf_counter() - t0
    print(f"[demo] finished in {seconds:.0f} s")
    return {"before": before, "after": after, "seconds": seconds, "hf_dir": hf_dir, **result}

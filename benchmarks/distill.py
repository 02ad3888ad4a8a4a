#!/usr/bin/env python
"""Distillation step time against its parts: teacher forward + student training step, same batch.

The teacher is the anchors' tiny Llama shape (--layers/--hidden/--heads/--mlp/--vocab, random
weights); the student has --student-layers layers of half the width and half the heads. Three
jitted programs on the same [--batch, --seq] batch, timed in interleaved rounds (--reps rounds
of --steps calls each; the first round is a warm-up):
  teacher_fwd_s   the teacher's forward to logits;
  student_step_s  the student's SFT training step (forward, backward, AdamW);
  distill_step_s  the distillation trainer's step: the teacher's forward inside the student's
                  step, logit loss (τ = 2, α = 0.5, forward KL), chunked logits (--chunk).
Writes `distill_over_parts` = distill_step_s / (teacher_fwd_s + student_step_s), medians; the
goal of issue #11 is <= 1.15.

Usage: .venv/bin/python benchmarks/distill.py --threads 2 --json out.json [--batch 8 --seq 256]
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import med, parse_args, write  # noqa: E402

args = parse_args([(("--student-layers",), dict(type=int, default=2)),
                   (("--chunk",), dict(type=int, default=256)),
                   (("--steps",), dict(type=int, default=5))])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import posttrain  # noqa: E402,F401  (first: CPU XLA defaults before JAX starts)
from posttrain import config as C  # noqa: E402
from posttrain.losses import sft_loss  # noqa: E402
from posttrain.losses.distill_step import make_distill_loss  # noqa: E402
from posttrain.models import Transformer, preset  # noqa: E402
from posttrain.train import init_state, make_optimizer, make_train_step, schedule  # noqa: E402


def main():
    shape = dict(vocab_size=args.vocab, num_heads=args.heads, num_kv_heads=args.kv_heads,
                 head_dim=args.hidden // args.heads)
    tcfg = preset("tiny-llama", embed_dim=args.hidden, num_layers=args.layers, mlp_dim=args.mlp,
                  max_position=max(1024, args.seq), **shape)
    scfg = tcfg.replace(embed_dim=args.hidden // 2, num_layers=args.student_layers, mlp_dim=args.mlp // 2,
                        num_heads=max(1, args.heads // 2), num_kv_heads=max(1, args.kv_heads // 2))
    teacher, student = Transformer(tcfg, rngs=nnx.Rngs(1)), Transformer(scfg, rngs=nnx.Rngs(0))
    B, T = args.batch, args.seq
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, args.vocab, (B, T)).astype(np.int32)
    batch = {"tokens": tokens, "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
             "segment_ids": np.ones((B, T), np.int32), "targets": np.roll(tokens, -1, 1),
             "weights": np.ones((B, T), np.float32)}
    batch["weights"][:, -1] = 0
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    optim = C.OptimSection(lr=1e-5, schedule="constant")
    opt = make_optimizer(optim, schedule(optim, 1000))

    tg, ts = nnx.split(teacher)
    fwd = jax.jit(lambda st, b: nnx.merge(tg, st)(b["tokens"], b["positions"], segment_ids=b["segment_ids"]).logits)
    graphdef, s_state = init_state(student, opt)
    sft_step = make_train_step(sft_loss, opt, graphdef)
    kd_loss = make_distill_loss(strategies=("logit",), temperature=2.0, alpha=0.5, chunk_size=args.chunk,
                                eval_metrics=False)  # as the trainer's step
    graphdef2, d_state = init_state(Transformer(scfg, rngs=nnx.Rngs(0)), opt)
    kd_step = make_train_step(kd_loss, opt, graphdef2, frozen_graphdef=tg)

    state = {"sft": s_state, "kd": d_state}

    def run_teacher():
        jax.block_until_ready(fwd(ts, batch))

    def run_student():
        state["sft"], m = sft_step(state["sft"], batch)
        jax.device_get(m["loss"])

    def run_distill():
        state["kd"], m = kd_step(state["kd"], batch, ts)
        jax.device_get(m["loss"])

    parts = {"teacher_fwd_s": run_teacher, "student_step_s": run_student, "distill_step_s": run_distill}
    times = {k: [] for k in parts}
    for r in range(args.reps + 1):
        for name, fn in parts.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
            if r:  # round 0 compiles and warms up
                times[name].append((time.perf_counter() - t0) / args.steps)
    res = {"lib": "posttrain", "jax": jax.__version__, **{k: med(v) for k, v in times.items()},
           "batch": B, "seq": T, "chunk": args.chunk, "threads": args.threads,
           "teacher": {"layers": tcfg.num_layers, "width": tcfg.embed_dim},
           "student": {"layers": scfg.num_layers, "width": scfg.embed_dim}}
    parts_s = res["teacher_fwd_s"]["median"] + res["student_step_s"]["median"]
    res["distill_over_parts"] = res["distill_step_s"]["median"] / parts_s
    print(f"[posttrain distill] step {res['distill_step_s']['median'] * 1e3:.1f} ms; teacher forward "
          f"{res['teacher_fwd_s']['median'] * 1e3:.1f} ms + student step {res['student_step_s']['median'] * 1e3:.1f} "
          f"ms; ratio {res['distill_over_parts']:.3f} (goal <= 1.15)", flush=True)
    write(res, args.json)


if __name__ == "__main__":
    main()

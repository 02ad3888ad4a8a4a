#!/usr/bin/env python
"""GRPO step time on the anchor checkpoint, same shapes as ../shared/anchors/trl_bench.py.

--batch completions per step = (--batch / --num-generations) prompts x --num-generations samples,
--prompt random prompt tokens, exactly --max-completion new tokens (no early stop), temperature 1,
beta --grpo-beta (0: no reference forward), reward = fraction of even token ids in the completion;
full fine-tune, AdamW 1e-5 (--lora R: LoRA rank R, 1e-4), loss dapo. A step is the GRPO trainer's own
step (`GRPOTrainer.setup`):
sampling on the train state's weights (one prefill per prompt), rewards, group advantages, one
prefix-shared row per prompt, then the train step; timed from the rollout call until the step's
metrics are on the host. Writes `grpo_step_s` (median, first step dropped; the anchors' key) and
`grpo_train_step_s` (the train step alone).

--layout both also trains a second state, from the same start, on the unshared layout of the same
rollouts (n rows [prompt | completion_i] per prompt: the prompt paid n times, loss with n = 1) and
writes `grpo_unshared_train_step_s` and `grpo_unshared_step_s` (rollout + unshared train step).

Usage: .venv/bin/python benchmarks/grpo.py --threads 2 --json out.json [--ckpt /tmp/tiny-llama]
       [--batch 64 --num-generations 8 --prompt 256]   (the larger shape of issue #10)
       [--layout both]                                 (prefix-shared rows against unshared rows)
"""

import dataclasses
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_checkpoint, med, parse_args, write  # noqa: E402

args = parse_args([(("--num-generations",), dict(type=int, default=4)),
                   (("--max-completion",), dict(type=int, default=32)),
                   (("--grpo-beta",), dict(type=float, default=0.0)),
                   (("--steps",), dict(type=int, default=6)),
                   (("--layout",), dict(choices=("shared", "both"), default="shared")),
                   (("--lora",), dict(type=int, default=0, help="> 0: LoRA of this rank (lr 1e-4) instead of full"))])

import jax  # noqa: E402
import numpy as np  # noqa: E402

import posttrain  # noqa: E402,F401  (first: CPU XLA defaults before JAX starts)
from posttrain import config as C  # noqa: E402
from posttrain.data.branches import ROW_FIELDS, SCORE_FIELDS, group_row  # noqa: E402
from posttrain.data.prompts import Prompt  # noqa: E402
from posttrain.losses.grpo import make_grpo_loss  # noqa: E402
from posttrain.train.trainer import place_batch  # noqa: E402
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer  # noqa: E402


def even_fraction(prompts, completions, completion_ids, **_):
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]


def unshared_rows(group, out, adv, n, T, pad_id):
    """The rollout's groups as n rows [prompt | completion_i] each (one branch a row): the unshared layout."""
    L = -(-(max(len(p.ids) for p in group) + T) // 8) * 8
    B = len(group) * n
    batch = {f: np.zeros((B, L), np.int32) for f in ROW_FIELDS}
    batch["tokens"][:] = pad_id
    batch.update({f: np.zeros((B, T), np.float32 if f == "score_w" else np.int32) for f in SCORE_FIELDS})
    for r in range(B):
        row = group_row(group[r // n].ids, [out.tokens[r, :out.lengths[r]]], T)
        for f in ROW_FIELDS:
            batch[f][r, :len(row["tokens"])] = row[f]
        for f in SCORE_FIELDS:
            batch[f][r] = row[f]
    batch["advantages"] = np.asarray(adv, np.float32).reshape(B, 1)
    batch["old_logps"] = np.asarray(out.logprobs, np.float32).reshape(B, T) * (batch["score_w"] != 0)
    return batch


def main():
    ckpt = ensure_checkpoint(args)
    G = args.num_generations
    if args.batch % G:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --num-generations {G}")
    tmp = tempfile.mkdtemp()
    with open(os.path.join(tmp, "p.jsonl"), "w") as fh:
        fh.write('{"prompt": "hello"}\n')
    cfg = C.from_dict(GRPOConfig, {
        "model": {"path": ckpt}, "data": {"train": os.path.join(tmp, "p.jsonl"), "max_prompt_length": args.prompt},
        "grpo": {"num_generations": G, "max_new_tokens": args.max_completion, "temperature": 1.0,
                 "beta": args.grpo_beta, "rewards": {"last_number": 1.0}},
        "lora": {"enabled": args.lora > 0, "rank": max(args.lora, 1)},
        "optim": {"lr": 1e-4 if args.lora else 1e-5, "schedule": "constant", "max_grad_norm": 1.0},
        "train": {"steps": args.steps, "batch_size": args.batch // G}, "run_dir": os.path.join(tmp, "run")})
    trainer = GRPOTrainer(cfg, progress=False)
    trainer.reward_funcs, trainer.reward_weights = [even_fraction], [1.0]  # the anchors' reward
    rng = np.random.default_rng(0)
    trainer.prompts = [Prompt(np.asarray([1] + rng.integers(3, args.vocab, args.prompt - 1).tolist(), np.int32),
                              "", {}) for _ in range(args.batch * (args.steps + 1))]
    trainer.length = -(-(args.prompt + G * args.max_completion) // 8) * 8
    parts = trainer.setup()
    rollout = parts.batches
    rollout.prompts = trainer.prompts
    rollout.params = dataclasses.replace(rollout.params, stop_ids=())  # exactly max_completion tokens
    state, times, train_times, seen = parts.state, [], [], {}
    if args.layout == "both" and args.grpo_beta:
        raise SystemExit("--layout both times the loss without a reference model: use --grpo-beta 0")
    if args.layout == "both":  # the same start and optimiser, the loss on one-branch rows
        trainer.loss_fn = make_grpo_loss(num_generations=1, max_new_tokens=args.max_completion, temperature=1.0,
                                         loss_type=cfg.grpo.loss_type, beta=0.0)
        unshared = trainer.setup()
        # a copy: both states hold the model's arrays, and each train step donates its state's buffers
        u_state, u_times, u_train = jax.tree.map(lambda x: x.copy(), unshared["state"]), [], []
        shared_rows = rollout.rows

        def rows(group, out, adv, keep):  # the shared rows, and the same rollout's unshared rows on the side
            t = time.perf_counter()
            seen["batch"] = unshared_rows(group, out, adv, G, args.max_completion, trainer.tokenizer.pad_id)
            seen["aside_s"] = time.perf_counter() - t  # not part of the shared step: taken off its time
            return shared_rows(group, out, adv, keep)

        rollout.rows = rows
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = rollout(state)
        t1 = time.perf_counter()
        t0 += seen.pop("aside_s", 0.0)
        state, metrics = parts.step(state, place_batch(batch))
        jax.device_get(metrics["loss"])
        times.append(time.perf_counter() - t0)
        train_times.append(time.perf_counter() - t1)
        if args.layout == "both":
            t2 = time.perf_counter()
            u_state, u_metrics = unshared["step"](u_state, place_batch(seen["batch"]))
            jax.device_get(u_metrics["loss"])
            u_train.append(time.perf_counter() - t2)
            u_times.append(t1 - t0 + u_train[-1])
            if len(u_times) == 1:  # the same start and rollout: the same gradient and entropy in both layouts
                show = lambda m: {k: round(float(m[k]), 6) for k in ("grad_norm", "entropy") if k in m}  # noqa: E731
                print(f"[posttrain grpo] first step, shared {show(metrics)} unshared {show(u_metrics)}", flush=True)
    stats = rollout.metrics()
    res = {"lib": "posttrain", "jax": jax.__version__, "grpo_step_s": {**med(times[1:]), "first_step_s": times[0]},
           "grpo_train_step_s": med(train_times[1:]),
           "grpo_generate_s": stats.get("time/generate_s"), "grpo_mean_completion_len": stats.get("completion/length"),
           "batch": args.batch, "prompt": args.prompt, "num_generations": G, "max_completion": args.max_completion,
           "grpo_beta": args.grpo_beta, "threads": args.threads}
    print(f"[posttrain grpo] grpo_step_s median {res['grpo_step_s']['median']:.3f} s/step (generate "
          f"{res['grpo_generate_s']:.3f} s, train step {res['grpo_train_step_s']['median']:.3f} s, first step "
          f"{times[0]:.2f} s)", flush=True)
    if args.layout == "both":
        res["grpo_unshared_train_step_s"], res["grpo_unshared_step_s"] = med(u_train[1:]), med(u_times[1:])
        print(f"[posttrain grpo] unshared rows: train step {res['grpo_unshared_train_step_s']['median']:.3f} s, "
              f"step {res['grpo_unshared_step_s']['median']:.3f} s", flush=True)
    write(res, args.json)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""PPO step time beside posttrain's GRPO step, on the GRPO anchor shapes (benchmarks/grpo.py).

--batch completions per step = (--batch / --num-generations) prompts x --num-generations samples,
--prompt random prompt tokens, exactly --max-completion new tokens (no early stop), temperature 1,
reward = fraction of even token ids in the completion; full fine-tune, AdamW 1e-5.
A PPO step is the PPO trainer's own step (`PPOTrainer.setup`) with one update per rollout
(num_iterations 1, one mini-batch), so it does what a GRPO step does (sampling on the train state's
weights, rewards, one update) plus PPO's own work: the reference forward for the KL penalty
(--kl-coef > 0) and the critic (--critic separate: its own Transformer, a forward in the rollout and
a forward + backward in the step; shared: a value head on the policy). The GRPO step is
`GRPOTrainer`'s (loss dapo, beta --grpo-beta) on the same shapes, in the same process.
Both are timed from the rollout call until the step's metrics are on the host; medians drop the
first (compiling) step. Writes `grpo_step_s`, `ppo_step_s` and `ppo_over_grpo` (separate critic, the
default), `ppo_shared_step_s` and `ppo_shared_over_grpo` (shared value head); --critic picks one.

Usage: .venv/bin/python benchmarks/ppo.py --threads 2 --json out.json [--ckpt /tmp/tiny-llama]
       [--critic shared] [--steps 6]
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
                   (("--kl-coef",), dict(type=float, default=0.05)),
                   (("--critic",), dict(choices=("separate", "shared", "both"), default="both")),
                   (("--steps",), dict(type=int, default=6))])

import jax  # noqa: E402
import numpy as np  # noqa: E402

import posttrain  # noqa: E402,F401  (first: CPU XLA defaults before JAX starts)
from posttrain import config as C  # noqa: E402
from posttrain.data.prompts import Prompt  # noqa: E402
from posttrain.train.trainer import place_batch  # noqa: E402
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from posttrain.trainers.ppo import PPOConfig, PPOTrainer  # noqa: E402


def even_fraction(prompts, completions, completion_ids, **_):
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]


def timed(trainer, prompts, G):
    """Per-step seconds of `trainer` (GRPO or PPO) on `prompts`, and its rollout statistics."""
    trainer.reward_funcs, trainer.reward_weights = [even_fraction], [1.0]  # the anchors' reward
    trainer.prompts = prompts
    trainer.length = -(-(args.prompt + G * args.max_completion) // 8) * 8
    parts = trainer.setup()
    rollout = parts.batches
    rollout.prompts = prompts
    rollout.params = dataclasses.replace(rollout.params, stop_ids=())  # exactly max_completion tokens
    state, times = parts.state, []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = rollout(state)
        state, metrics = parts.step(state, place_batch(batch))
        jax.device_get(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return times, rollout.metrics()


def main():
    ckpt = ensure_checkpoint(args)
    G = args.num_generations
    if args.batch % G:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --num-generations {G}")
    tmp = tempfile.mkdtemp()
    with open(os.path.join(tmp, "p.jsonl"), "w") as fh:
        fh.write('{"prompt": "hello"}\n')
    common = {"model": {"path": ckpt}, "data": {"train": os.path.join(tmp, "p.jsonl"),
                                                "max_prompt_length": args.prompt},
              "optim": {"lr": 1e-5, "schedule": "constant", "max_grad_norm": 1.0},
              "train": {"steps": args.steps, "batch_size": args.batch // G}}
    sampling = {"num_generations": G, "max_new_tokens": args.max_completion, "temperature": 1.0,
                "rewards": {"last_number": 1.0}}
    grpo = C.from_dict(GRPOConfig, {**common, "grpo": {**sampling, "beta": args.grpo_beta},
                                    "run_dir": os.path.join(tmp, "grpo")})
    critics = ("separate", "shared") if args.critic == "both" else (args.critic,)
    ppo = {k: C.from_dict(PPOConfig, {**common, "ppo": {**sampling, "num_iterations": 1, "beta": args.kl_coef,
                                                        "critic": k}, "run_dir": os.path.join(tmp, "ppo_" + k)})
           for k in critics}
    rng = np.random.default_rng(0)
    prompts = [Prompt(np.asarray([1] + rng.integers(3, args.vocab, args.prompt - 1).tolist(), np.int32), "", {})
               for _ in range(args.batch * (args.steps + 1))]
    g_times, g_stats = timed(GRPOTrainer(grpo, progress=False), prompts, G)
    g = med(g_times[1:])
    res = {"lib": "posttrain", "jax": jax.__version__, "grpo_step_s": {**g, "first_step_s": g_times[0]},
           "grpo_generate_s": g_stats.get("time/generate_s"), "kl_coef": args.kl_coef, "batch": args.batch,
           "prompt": args.prompt, "num_generations": G, "max_completion": args.max_completion,
           "grpo_beta": args.grpo_beta, "threads": args.threads}
    for k in critics:  # keys: ppo_* for the separate critic (the default), ppo_shared_* for the shared head
        name = "ppo" if k == "separate" else "ppo_shared"
        p_times, p_stats = timed(PPOTrainer(ppo[k], progress=False), prompts, G)
        p = med(p_times[1:])
        res.update({f"{name}_step_s": {**p, "first_step_s": p_times[0]}, f"{name}_over_grpo": p["median"] / g["median"],
                    f"{name}_generate_s": p_stats.get("time/generate_s"),
                    f"{name}_prepare_s": p_stats.get("time/prepare_s")})
        print(f"[posttrain ppo] {k} critic: {name}_step_s median {p['median']:.3f} s/step (generate "
              f"{p_stats['time/generate_s']:.3f} s, critic + reference forward {p_stats['time/prepare_s']:.3f} s); "
              f"grpo_step_s median {g['median']:.3f} s/step; ratio {p['median'] / g['median']:.2f}", flush=True)
    write(res, args.json)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""One GPU benchmark: SFT step MFU and tokens/s, GRPO rollout tokens/s and step time, peak memory vs the plan.

On an NVIDIA GPU (run through benchmarks/gpu.sh, which installs JAX with CUDA when needed):
  1. SFT: a randomly initialised Llama-shaped model (preset llama3-1b, ~1.24B parameters: no download),
     float32 parameters with bfloat16 compute (posttrain's mixed precision), AdamW 1e-4, random tokens,
     batch x seq, through posttrain's own train step (as benchmarks/train.py). Tokens/s, step time, MFU
     against a bfloat16 matmul peak measured in this process (as train.metrics.measure_peak_flops does
     for float32), the device's peak_bytes_in_use against `posttrain plan`'s estimate (posttrain.plan.plan,
     the function behind the command) for the same config.
  2. With several GPUs: the same for llama3-8b on the fsdp sharding preset over all of them (remat when
     the plan says it does not fit otherwise; its peak read on the devices the 1B run did not touch).
     With one GPU the row says why it is skipped.
  3. GRPO on the same model shape (as benchmarks/grpo.py: the GRPO trainer's own setup(), its policy
     being this model): prompts x n samples of exactly --new-tokens tokens from posttrain's Sampler, the
     rollout's new tokens/s, and the step time (rollout + train step, first step dropped).
Prints one Markdown table (metric | value | note) and writes --json PATH. A time budget (--budget-s)
is checked between steps: later sections get their reserve, steps stop early, a section that cannot
fit is skipped with the reason in the table.

--dry-run: the same code path on CPU with a tiny model (demo-tiny, float32), tiny shapes; under a
minute. Run by tests/test_gpu_bench.py so the script cannot rot.

Usage: bash benchmarks/gpu.sh [--json out.json] [--batch 4 --seq 2048 ...]
       bash benchmarks/gpu.sh --dry-run [--json out.json]
"""

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from unittest import mock

T_START = time.perf_counter()

GPU = dict(preset="llama3-1b", big_preset="llama3-8b", param_dtype="float32", dtype="bfloat16", batch=4, seq=2048,
           steps=10, big_batch_per_device=1, big_seq=2048, big_steps=5, prompts=8, generations=8, prompt_len=128,
           new_tokens=128, grpo_steps=4, matmul_n=8192, budget_s=420.0)
DRY = dict(preset="demo-tiny", big_preset="tiny-llama", param_dtype="float32", dtype="float32", batch=2, seq=64,
           steps=2, big_batch_per_device=1, big_seq=64, big_steps=2, prompts=2, generations=2, prompt_len=16,
           new_tokens=8, grpo_steps=2, matmul_n=256, budget_s=600.0)
# Seconds a section is expected to need on a GPU (compile + a few steps): the reserve kept for it.
EST = dict(big=150.0, grpo=120.0)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny model on CPU, same code path (CI)")
    ap.add_argument("--json", default=None, help="write the results here")
    for k, v in GPU.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None, help=f"GPU default {v}")
    args = ap.parse_args()
    for k, v in (DRY if args.dry_run else GPU).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


args = parse_args()
if args.dry_run:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import posttrain  # noqa: E402,F401,I001  (first: CPU XLA defaults before JAX starts)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from posttrain import config as C  # noqa: E402
from posttrain import sharding as sh  # noqa: E402
from posttrain.data.prompts import Prompt  # noqa: E402
from posttrain.losses import sft_loss  # noqa: E402
from posttrain.models import Transformer, count_params, preset  # noqa: E402
from posttrain.plan import KEYS, plan  # noqa: E402
from posttrain.train import init_state, make_train_step  # noqa: E402
from posttrain.train.trainer import place_batch  # noqa: E402
from posttrain.plan import flops_per_token  # noqa: E402
from posttrain.trainers import grpo as grpo_module  # noqa: E402
from posttrain.recipes.build import memory_plan  # noqa: E402


def left() -> float:
    """Seconds of the budget left."""
    return args.budget_s - (time.perf_counter() - T_START)


def log(msg: str) -> None:
    print(f"[gpu-bench {time.perf_counter() - T_START:6.1f}s] {msg}", flush=True)


def gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def on_cpu() -> bool:
    return jax.devices()[0].platform == "cpu"


def device_stat(devices, key: str):
    """max over `devices` of memory_stats()[key]; None on CPU (no device allocator statistics)."""
    if on_cpu():
        return None
    vals = []
    for d in devices:
        try:
            s = d.memory_stats()
        except Exception:  # some backends raise instead of returning None
            s = None
        if s and key in s:
            vals.append(int(s[key]))
    return max(vals) if vals else None


def matmul_peak(n: int, dtype: str, reps: int = 5, inner: int = 10) -> float:
    """Best observed FLOP/s of an n x n `dtype` matmul (inner calls back to back, best of reps)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(f(a, b))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready([f(a, b) for _ in range(inner)])
        best = min(best, (time.perf_counter() - t0) / inner)
    return 2.0 * n**3 / best


def build(cfg, mesh=None, rules=None):
    """A random model of `cfg`, initialised in one jit (sharded over `mesh` when given)."""
    fn = lambda: Transformer(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    if mesh is not None:
        return sh.create_sharded(fn, mesh, rules)
    graphdef, _ = nnx.split(nnx.eval_shape(fn))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.split(fn())[1])())


def model_cfg(name: str, **kw):
    return preset(name, param_dtype=args.param_dtype, dtype=args.dtype, **kw)


def plan_bytes(p: dict) -> dict:
    return {k: p[k] for k in (*KEYS, "total")}


def fit(cfg, B, T, shape, preset_name, shrink=False):
    """(cfg, B): remat on, then (shrink) halved batches, until the plan is under 85 % of a device's
    memory limit; unchanged on CPU (no limit). None when nothing fits."""
    limit = device_stat(jax.devices(), "bytes_limit")
    for remat in (cfg.remat, True):
        cfg = cfg.replace(remat=remat)
        b = B
        while True:
            need = plan(cfg, batch=b, seq_len=T, mesh_shape=shape, preset=preset_name, remat=remat)["total"]
            if limit is None or need < 0.85 * limit:
                if (cfg.remat, b) != (False, B):
                    log(f"  the plan ({gib(need)}) needs remat {cfg.remat}, batch {b} to fit {gib(limit)}")
                return cfg, b
            if not shrink or b == 1:
                break
            b //= 2
    return None, None


def sft(cfg, B, T, steps, reserve, mesh=None, rules=None, mesh_shape=None, preset_name="dp", peak_devices=None):
    """SFT steps on random tokens; times, tokens/s, FLOPs per step, peak memory and the plan."""
    model = build(cfg, mesh, rules)
    n_params = count_params(model)
    opt = optax.adamw(1e-4)
    graphdef, state = init_state(model, opt)
    if mesh is not None:
        state = sh.shard_state(state, mesh, rules)
    del model
    step = make_train_step(sft_loss, opt, graphdef, mesh=mesh, rules=rules)
    rng = np.random.default_rng(0)

    def batch():
        ids = rng.integers(3, cfg.vocab_size, (B, T + 1)).astype(np.int32)
        b = {"tokens": ids[:, :-1], "targets": ids[:, 1:],
             "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
             "segment_ids": np.ones((B, T), np.int32), "weights": np.ones((B, T), np.float32)}
        return jax.block_until_ready(place_batch(b, mesh, rules))

    batches = [batch(), batch()]
    t0 = time.perf_counter()
    state, m = step(state, batches[0])
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    log(f"  first step (compile + run) {first:.1f} s")
    times = []
    for i in range(steps):
        if len(times) >= 2 and left() < reserve:
            log(f"  time budget: stopping after {len(times)} timed steps")
            break
        t0 = time.perf_counter()
        state, m = step(state, batches[(i + 1) % 2])
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    mesh_shape = mesh_shape or {"data": 1}
    p = plan(cfg, batch=B, seq_len=T, mesh_shape=mesh_shape, preset=preset_name, remat=cfg.remat)
    peak = device_stat(peak_devices or jax.devices()[:1], "peak_bytes_in_use")
    res = {"n_params": n_params, "batch": B, "seq": T, "remat": cfg.remat, "param_dtype": cfg.param_dtype,
           "dtype": cfg.dtype, "first_step_s": first, "step_s": med, "step_times": [round(t, 5) for t in times],
           "tok_s": B * T / med, "flops_per_step": flops_per_token(cfg, T) * B * T,
           "final_loss": float(m["loss"]), "peak_bytes": peak, "plan": plan_bytes(p),
           "plan_total_bytes": p["total"], "peak_over_plan": None if peak is None else peak / p["total"],
           "mesh_shape": mesh_shape, "sharding_preset": preset_name}
    del state, batches, m
    gc.collect()
    return res


def sft_fsdp(reserve):
    """llama3-8b (dry run: tiny-llama) on the fsdp preset over every device, or a skip reason."""
    n = jax.device_count()
    if n < 2:
        return {"skipped": f"{n} {jax.devices()[0].platform.upper()} device visible: the {args.big_preset} "
                           "FSDP run needs several"}
    if left() < reserve + EST["big"] and not args.dry_run:
        return {"skipped": f"time budget: {left():.0f} s left, {reserve + EST['big']:.0f} s needed"}
    B, T = args.big_batch_per_device * n, args.big_seq
    shape = {"fsdp": n}
    cfg, _ = fit(model_cfg(args.big_preset), B, T, shape, "fsdp")
    if cfg is None:
        return {"skipped": f"the plan of batch {B} x {T} does not fit 85 % of a device's memory even with remat"}
    mesh, rules = sh.make_mesh("fsdp"), sh.preset_rules("fsdp")
    log(f"SFT {args.big_preset} fsdp over {n} devices, batch {B} x {T}, remat {cfg.remat}")
    return sft(cfg, B, T, args.big_steps, reserve, mesh, rules, shape, "fsdp", peak_devices=jax.devices()[1:])


def even_fraction(prompts, completions, completion_ids, **_):
    """benchmarks/grpo.py's reward: the share of even token ids in the completion."""
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]


def grpo(cfg):
    """GRPO steps through the trainer's own setup() with `cfg`'s model as the policy."""
    P, G, L, N = args.prompts, args.generations, args.prompt_len, args.new_tokens
    if not args.dry_run and left() < 60:
        return {"skipped": f"time budget: {left():.0f} s left, a GRPO step compiles for about a minute"}
    cfg, _ = fit(cfg, P, L + G * N, {"data": 1}, "dp")
    if cfg is None:
        return {"skipped": f"the plan of {P} rows of {L + G * N} tokens does not fit even with remat"}
    tmp = tempfile.mkdtemp(prefix="gpu-bench-")
    with open(os.path.join(tmp, "p.jsonl"), "w") as fh:
        fh.write('{"prompt": "hello"}\n')
    gcfg = C.from_dict(grpo_module.GRPOConfig, {
        "model": {"preset": args.preset, "dtype": args.param_dtype, "compute_dtype": args.dtype, "remat": cfg.remat},
        "data": {"train": os.path.join(tmp, "p.jsonl"), "max_prompt_length": L},
        "grpo": {"num_generations": G, "max_new_tokens": N, "temperature": 1.0, "beta": 0.0,
                 "rewards": {"last_number": 1.0}},
        "optim": {"lr": 1e-5, "schedule": "constant", "max_grad_norm": 1.0},
        "train": {"steps": args.grpo_steps, "batch_size": P}, "run_dir": os.path.join(tmp, "run")})
    model = build(cfg)  # the benchmark's model (full vocabulary), not the preset sized to the byte tokenizer
    with mock.patch("posttrain.recipes.rl.build_model", lambda *a, **k: model):  # RLRecipe builds the policy
        trainer = grpo_module.GRPOTrainer(gcfg, progress=False)
    trainer.reward_funcs, trainer.reward_weights = [even_fraction], [1.0]
    rng = np.random.default_rng(0)
    trainer.prompts = [Prompt(np.asarray([1] + rng.integers(3, cfg.vocab_size, L - 1).tolist(), np.int32), "", {})
                       for _ in range(P * (args.grpo_steps + 1))]
    trainer.longest, trainer.length = L, -(-(L + G * N) // 8) * 8  # the prompt bucket and the row
    parts = trainer.setup()
    rollout = parts.batches
    rollout.prompts = trainer.prompts
    rollout.params = dataclasses.replace(rollout.params, stop_ids=())  # exactly N new tokens per sample
    state, steps, gens, new = parts.state, [], [], []
    for i in range(args.grpo_steps):
        if i >= 2 and left() < 1.5 * steps[-1] + 5:
            log(f"  time budget: stopping after {i} GRPO steps")
            break
        t0 = time.perf_counter()
        batch = rollout(state)
        state, metrics = parts.step(state, place_batch(batch))
        jax.device_get(metrics["loss"])
        steps.append(time.perf_counter() - t0)
        st = rollout.metrics()
        gens.append(st["time/generate_s"])
        new.append(st["completion/length"] * P * G)
        log(f"  GRPO step {i + 1}: {steps[-1]:.2f} s (generate {gens[-1]:.2f} s)")
    timed = slice(1, None) if len(steps) > 1 else slice(None)  # the first step compiles
    gen_s = statistics.median(gens[timed])
    seq, kv = trainer.plan_rows(gcfg)
    p = memory_plan(gcfg, cfg, {"data": 1}, seq_len=seq, kv_cache_tokens=kv)
    res = {"prompts": P, "generations": G, "prompt_len": L, "new_tokens": N, "row_tokens": trainer.length,
           "remat": cfg.remat, "step_s": statistics.median(steps[timed]), "first_step_s": steps[0],
           "step_times": [round(t, 4) for t in steps],
           "generate_s": gen_s, "rollout_tok_s": statistics.median(new[timed]) / gen_s,
           "includes_compile": len(steps) == 1, "plan_total_bytes": p["total"],
           "plan": plan_bytes(p)}
    del state, parts, trainer, rollout
    gc.collect()
    return res


def si(x: float, unit: str) -> str:
    for s, p in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= p:
            return f"{x / p:.2f} {s}{unit}"
    return f"{x:.2f} {unit}"


def count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def table(res: dict) -> list:
    s, f, g = res["sft"], res["sft_fsdp"], res["grpo"]
    peak, mm = res["matmul_peak_flops"], res["matmul_dtype"]
    shape = f"params {s['param_dtype']}, compute {s['dtype']}, batch {s['batch']} x {s['seq']} tokens"
    rows = [("device", f"{res['device_kind']} x{res['n_devices']}", f"jax {res['jax']}, backend {res['backend']}"
             + (", DRY RUN (tiny model on CPU)" if res["dry_run"] else "")),
            (f"{mm} matmul peak", si(peak, "FLOP/s"), f"measured {res['matmul_n']}^2 {mm} matmul, this process"),
            ("SFT model", f"{count(s['n_params'])} params", f"{res['preset']} shape, random init; {shape}"),
            ("SFT step time", f"{s['step_s'] * 1e3:.1f} ms", f"median of {len(s['step_times'])} steps; "
             f"first step (compile) {s['first_step_s']:.1f} s"),
            ("SFT tokens/s", f"{s['tok_s']:,.0f}", "AdamW full fine-tune, posttrain train step"),
            ("SFT MFU", f"{s['mfu']:.1%}", f"{si(s['flops_per_step'] / s['step_s'], 'FLOP/s')} model FLOPs "
             f"vs the measured {mm} matmul peak"),
            ("SFT peak device memory", gib(s["peak_bytes"]), "peak_bytes_in_use" if s["peak_bytes"] is not None
             else "no device allocator statistics on CPU"),
            ("SFT plan estimate", gib(s["plan_total_bytes"]), "posttrain plan (preset dp, 1 device)"),
            ("SFT measured / plan", "n/a" if s["peak_over_plan"] is None else f"{s['peak_over_plan']:.2f}",
             "peak_bytes_in_use / plan total")]
    if "skipped" in f:
        rows.append((f"SFT {res['big_preset']} FSDP", "skipped", f["skipped"]))
    else:
        tag = f"SFT {res['big_preset']} FSDP"
        rows += [(f"{tag} tokens/s", f"{f['tok_s']:,.0f}", f"{count(f['n_params'])} params, batch {f['batch']} x "
                  f"{f['seq']}, fsdp {res['n_devices']}, remat {f['remat']}, step {f['step_s']:.2f} s"),
                 (f"{tag} MFU", f"{f['mfu']:.1%}", f"vs {res['n_devices']} x the measured {mm} matmul peak"),
                 (f"{tag} peak / plan", f"{gib(f['peak_bytes'])} / {gib(f['plan_total_bytes'])}",
                  "per device; peak on the devices the first SFT run did not use")]
    if "skipped" in g:
        rows.append(("GRPO", "skipped", g["skipped"]))
    else:
        rows += [("GRPO rollout tokens/s", f"{g['rollout_tok_s']:,.0f}", f"{g['prompts']} prompts x "
                  f"{g['generations']} samples x {g['new_tokens']} new tokens, prompt {g['prompt_len']}; Sampler "
                  f"generate time {g['generate_s']:.2f} s"),
                 ("GRPO step time", f"{g['step_s']:.2f} s", "rollout + rewards + train step, median of "
                  f"{max(1, len(g['step_times']) - 1)}" + (" (includes compile)" if g["includes_compile"] else
                                                            f"; first step {g['first_step_s']:.1f} s")),
                 ("GRPO plan estimate", gib(g["plan_total_bytes"]), f"posttrain plan for the GRPO config "
                  f"(rows of {g['row_tokens']} tokens, remat {g['remat']})")]
    rows += [("peak device memory (whole run)", gib(res["peak_bytes"]), "device 0, every section"),
             ("wall time", f"{res['wall_s']:.0f} s", f"budget {args.budget_s:.0f} s")]
    return rows


def main():
    dev = jax.devices()[0]
    log(f"{dev.device_kind} x{jax.device_count()}, jax {jax.__version__}, budget {args.budget_s:.0f} s")
    if not args.dry_run and on_cpu():
        raise SystemExit("gpu.py: JAX sees no GPU (use benchmarks/gpu.sh, which installs jax[cuda12]; "
                         "or --dry-run for the CPU check)")
    cfg = model_cfg(args.preset)
    multi = jax.device_count() > 1
    reserve = EST["grpo"] + (EST["big"] if multi else 0.0)
    if args.dry_run:
        reserve = 0.0
    log(f"SFT {args.preset}, batch {args.batch} x {args.seq}, params {args.param_dtype}, compute {args.dtype}")
    cfg1, batch = fit(cfg, args.batch, args.seq, {"data": 1}, "dp", shrink=True)
    if cfg1 is None:
        raise SystemExit(f"gpu.py: even batch 1 x {args.seq} with remat does not fit the plan; lower --seq")
    s = sft(cfg1, batch, args.seq, args.steps, reserve)
    log(f"  {s['tok_s']:,.0f} tok/s, step {s['step_s'] * 1e3:.1f} ms")
    mm_dtype = args.dtype
    peak = matmul_peak(args.matmul_n, mm_dtype)
    s["mfu"] = s["flops_per_step"] / s["step_s"] / peak
    f = sft_fsdp(0.0 if args.dry_run else EST["grpo"])
    if "skipped" in f:
        log(f"SFT {args.big_preset} FSDP skipped: {f['skipped']}")
    else:
        f["mfu"] = f["flops_per_step"] / f["step_s"] / (peak * jax.device_count())
    log(f"GRPO on {args.preset}: {args.prompts} prompts x {args.generations} samples x {args.new_tokens} tokens")
    g = grpo(cfg)
    if "skipped" in g:
        log(f"GRPO skipped: {g['skipped']}")
    res = {"dry_run": args.dry_run, "device_kind": dev.device_kind, "backend": jax.default_backend(),
           "n_devices": jax.device_count(), "jax": jax.__version__, "preset": args.preset,
           "big_preset": args.big_preset, "matmul_n": args.matmul_n, "matmul_dtype": mm_dtype,
           "matmul_peak_flops": peak, "sft": s, "sft_fsdp": f, "grpo": g,
           "peak_bytes": device_stat(jax.devices()[:1], "peak_bytes_in_use"),
           "budget_s": args.budget_s, "wall_s": time.perf_counter() - T_START,
           # the headline numbers, flat
           "train_tok_s": s["tok_s"], "train_mfu": s["mfu"], "train_peak_bytes": s["peak_bytes"],
           "plan_total_bytes": s["plan_total_bytes"], "peak_over_plan": s["peak_over_plan"],
           "rollout_tok_s": g.get("rollout_tok_s"), "grpo_step_s": g.get("step_s")}
    rows = table(res)
    res["table"] = [list(r) for r in rows]
    print("\n| metric | value | note |\n|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(c).replace("|", "/") for c in r) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

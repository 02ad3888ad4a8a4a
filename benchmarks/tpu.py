#!/usr/bin/env python
"""The TPU benchmark: one measurement per process (a clean `peak_bytes_in_use`), appended as a JSON line.

Sections (--only NAME; scripts/tpu.sh runs a list of them, one process each):
  peak                 bf16 n x n matmul FLOP/s (the MFU yardstick)
  sft:B:T:M:REMAT      full fine-tune of the llama3-1b preset (random weights), bf16 parameters and AdamW moments,
                       B rows x T tokens per optimizer step in M micro-batches; REMAT none | full | dots
  lora:B:T:M:REMAT     the same with LoRA rank 16 on every projection (base frozen, bf16)
  sample:B:P:N         the Sampler, bf16 weights, B prompts of P tokens, N greedy new tokens: new tok/s, the decode
                       step against the bytes it must read (weights + the mean filled KV cache, as stored:
                       --kv-dtype float8_e4m3fn or int8 holds it in 1 byte an element) at 819 GB/s
  grpo:P:G:L:N:REMAT   GRPO steps through the trainer's own setup(): P prompts x G samples of N new tokens,
                       prompt L (the sampler, rewards, the prefix-shared update)
Each line: the section, its figures, the device, the first call (compile + run) and `plan` where one applies.
MFU is model FLOPs (plan.flops_per_token) per second over the `peak` section's measured FLOP/s (--peak-flops).

Usage (on the chip): python benchmarks/tpu.py --only sft:8:2048:8:none --jsonl out.jsonl [--peak-flops 1.8e14]
       python benchmarks/tpu.py --only sft:2:64:1:none --preset demo-tiny --jsonl out.jsonl   (CPU check)
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from unittest import mock

T0 = time.perf_counter()
ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--only", required=True, help="one section, e.g. sft:8:2048:8:none")
ap.add_argument("--jsonl", required=True, help="append the result line here")
ap.add_argument("--preset", default="llama3-1b")
ap.add_argument("--shape", default="", help="ModelConfig fields replaced, e.g. num_layers=4,vocab_size=32768,"
                "tie_embeddings=false (the side-by-side runs against Tunix use its model's shape)")
ap.add_argument("--dtype", default="bfloat16", help="parameter and compute dtype: bfloat16 | float32")
ap.add_argument("--steps", type=int, default=5, help="timed steps / calls after the first")
ap.add_argument("--peak-flops", type=float, default=None, help="bf16 matmul FLOP/s for MFU (the peak section's)")
ap.add_argument("--profile", default=None, help="trace one more call with jax.profiler into this folder and add "
                "the device's per-op totals to the line (profile_ops)")
ap.add_argument("--rollout-dtype", default=None, help="grpo: the sampler's precision (rollout.dtype), e.g. bfloat16 "
                "beside a float32 model; the line gets the sampler/trainer mismatch KL (sampling/mismatch_kl)")
ap.add_argument("--is-mode", default=None, help="grpo: rollout.is_mode, the mismatch correction (token_truncate, ...)")
ap.add_argument("--decode-kernel", default=None, action=argparse.BooleanOptionalAction,
                help="sample: a TPU's decode steps through the Pallas kernel (attention.DECODE_KERNEL, "
                     "off by default) or the dense XLA path (--no-decode-kernel)")
ap.add_argument("--kv-dtype", default=None, help="sample, grpo: the KV cache's storage dtype (Sampler kv_dtype, "
                "rollout.kv_dtype), e.g. float8_e4m3fn; default: the compute dtype")
ap.add_argument("--prefill-effort", type=float, default=None, help="sample: XLA's exec_time_optimization_effort "
                "for the prefill program alone (Sampler.prefill_compile_options), e.g. -1.0: a shorter first call")
ap.add_argument("--quick-prefill", default=None, action=argparse.BooleanOptionalAction,
                help="sample: Sampler.quick_first_prefill (default: off, the Sampler's; what `posttrain generate` "
                     "turns on); --quick-prefill also splits the programs on a CPU (concurrent_compile)")
ap.add_argument("--hbm-gbs", type=float, default=819.0, help="HBM bandwidth, GB/s (v5e: 819)")
ap.add_argument("--no-clip", action="store_true", help="sft/lora: plain AdamW without the trainer's default "
                "global-norm clipping (optim.max_grad_norm: null): the gradients need not all be live at once")
ap.add_argument("--splash-block", type=int, default=None, help="the splash-attention tile (models/attention_tpu.py "
                "BLOCKS: the largest that divides the row is used), e.g. 1024")
args = ap.parse_args()
if args.decode_kernel is not None:
    import posttrain.models.attention as _attention

    _attention.DECODE_KERNEL = args.decode_kernel

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from aot import memory  # noqa: E402
from flax import nnx  # noqa: E402

from posttrain.losses import sft_loss  # noqa: E402
from posttrain.models import Transformer, count_params, preset  # noqa: E402
from posttrain.models.lora import LoraParam, apply_lora  # noqa: E402
from posttrain.plan import KEYS, flops_per_token, plan  # noqa: E402
from posttrain.train import init_state, make_train_step  # noqa: E402
from posttrain.train.optim import make_optimizer  # noqa: E402

if args.splash_block:
    from posttrain.models import attention_tpu  # noqa: E402

    attention_tpu.BLOCKS = (args.splash_block, *attention_tpu.BLOCKS)


def stat(key):
    try:
        return int((jax.devices()[0].memory_stats() or {}).get(key))
    except Exception:  # CPU: no allocator statistics
        return None


def _value(v: str):
    return {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)


SHAPE = {k: _value(v) for k, v in (kv.split("=") for kv in args.shape.split(",") if kv)}


def model_config(**kw):
    # --shape dtype=bfloat16 with --dtype float32: float32 parameters, bfloat16 compute
    return preset(args.preset, **{"param_dtype": args.dtype, "dtype": args.dtype, **SHAPE}, **kw)


def build(cfg):
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1])())


def timed(fn, n, profile=True, settle=None):
    """fn's first call (compiles) and n more; settle(): run between them (what the steady state waits for)."""
    t = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t
    if settle is not None:
        settle()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    if args.profile and profile:
        with jax.profiler.trace(args.profile):
            fn()
    return out, first, times


def profile_ops(folder, top=40):
    """Per-op device time of the traced call: {line: [[name, count, total ms, a stat], ...]} for each device
    plane's lines (XLA Modules, XLA Ops, ...), the longest first."""
    import glob

    from jax.profiler import ProfileData

    files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return {}
    out = {}
    for plane in ProfileData.from_file(max(files, key=os.path.getmtime)).planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            agg = {}
            for e in line.events:
                a = agg.setdefault(e.name, [0, 0.0, ""])
                a[0] += 1
                a[1] += e.duration_ns / 1e6
                if not a[2]:
                    st = dict(e.stats)
                    a[2] = str(st.get("long_name") or st.get("hlo_category") or st.get("tf_op") or "")[:160]
            rows = sorted(([k, *v] for k, v in agg.items()), key=lambda r: -r[2])[:top]
            out[f"{plane.name} {line.name}"] = [[n, c, round(ms, 3), st] for n, c, ms, st in rows]
    return out


def peak(n=8192):
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    best = min(timed(lambda: jax.block_until_ready([f(a) for _ in range(10)]), 0)[1] / 10 for _ in range(5))
    return {"matmul_n": n, "peak_flops": 2.0 * n ** 3 / best}


def train(kind, B, T, M, remat):
    cfg = model_config(remat=remat != "none", remat_policy="full" if remat == "none" else remat)
    model = build(cfg)
    trainable = nnx.Param
    if kind == "lora":
        apply_lora(model, rank=16, alpha=32.0)
        trainable = LoraParam
    # the trainer's default optimizer (train/optim.py: global-norm clipping at 1.0, then AdamW), constant lr
    from posttrain.config import OptimSection

    opt = optax.adamw(1e-5) if args.no_clip else make_optimizer(OptimSection(schedule="constant"), 1e-5)
    graphdef, state = init_state(model, opt, trainable=trainable)
    del model
    step = make_train_step(sft_loss, opt, graphdef, micro_batches=M, trainable=trainable)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    batch = jax.device_put({"tokens": ids[:, :-1], "targets": ids[:, 1:],
                            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
                            "segment_ids": np.ones((B, T), np.int32), "weights": np.ones((B, T), np.float32)})
    box = [state]

    def run():
        box[0], m = step(box[0], batch)
        return jax.block_until_ready(m)

    m, first, times = timed(run, args.steps)
    s = statistics.median(times)
    mem = xla_memory(step, box[0], batch)
    p = plan(cfg, batch=B // M, seq_len=T, mesh_shape={"data": 1}, preset="dp", remat=cfg.remat,
             trainable="lora" if kind == "lora" else "full", lora_rank=16, micro_batches=M,
             device_bytes=stat("bytes_limit"))
    return {"n_params": count_params(box[0].params) + count_params(box[0].rest), "batch": B, "seq": T,
            "micro_batches": M, "remat": remat, "clip": not args.no_clip, "step_s": s,
            "step_times": [round(t, 4) for t in times],
            "first_step_s": first, "tok_s": B * T / s, "model_flops_s": flops_per_token(cfg, T) * B * T / s,
            "loss": float(m["loss"]), "plan": {k: p[k] for k in (*KEYS, "demand", "total", "fitted")},
            "xla_memory": mem,
            "plan_over_xla": p["total"] / mem["peak"] if "peak" in mem else None}


def xla_memory(jitted, *example):
    """The compiled program's own account of its memory (`memory_analysis`, the persistent cache makes the second
    compile a load): arguments + outputs - donated aliases + temporaries, the peak it needs on the device."""
    try:
        compiled = jitted.lower(*example).compile()
    except Exception as e:
        return {"error": repr(e)[:200]}
    return memory(compiled)


def sample(B, P, N):
    from posttrain.generate import Sampler, SamplingParams
    from posttrain.models.transformer import KVCache

    cfg = model_config()
    model = build(cfg)
    sampler = Sampler(model, max_len=P + N, kv_dtype=args.kv_dtype)
    if args.prefill_effort is not None:
        sampler.prefill_compile_options = {"exec_time_optimization_effort": args.prefill_effort}
    if args.quick_prefill is not None:
        sampler.quick_first_prefill = args.quick_prefill
        if args.quick_prefill:  # the split programs (the quick prefill's path) on a CPU too
            sampler.concurrent_compile = True
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, cfg.vocab_size, P - 1).tolist() for _ in range(B)]
    params = SamplingParams(max_new_tokens=N, temperature=0.0)
    pairs = []  # the quick first prefill and its default-effort replacement (programs.Upgrade), --quick-prefill
    out, first, times = timed(lambda: sampler.generate(prompts, params, key=jax.random.key(0)), args.steps,
                              settle=lambda: pairs.extend(sampler._programs.settle()))
    assert (np.asarray(out.lengths) == N).all()
    quick_equal = quick_diff = quick_argmax = None
    if pairs:  # both prefill programs on the same inputs: the same bits? (the calls may switch between them)
        a, b = (jax.tree.leaves(prog(sampler._weights, *sampler._programs.last_prefill_args)) for prog in pairs[0])
        quick_equal = all(bool(jnp.array_equal(x, y)) for x, y in zip(a, b))
        quick_diff = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) for x, y in zip(a, b)
                      if jnp.issubdtype(x.dtype, jnp.floating)]  # per floating output: logits, then the cache
        quick_argmax = float(jnp.mean(jnp.argmax(a[0], -1) == jnp.argmax(b[0], -1)))
    s = statistics.median(times)
    programs = sampler._programs.last_build  # the first call's timeline: each program lowered / compiled (programs.py)
    # the same prompts with one new token: the prefill's program alone (no decode step is compiled), so the
    # decode step is (call - prefill call) / (N - 1)
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    _, first1, times1 = timed(lambda: sampler.generate(prompts, one, key=jax.random.key(0)), args.steps,
                              profile=False, settle=sampler._programs.settle)  # --profile traces the call above
    s1 = statistics.median(times1)
    step = (s - s1) / (N - 1)
    w = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    kv_dt = jnp.dtype(sampler.kv_dtype or args.dtype)  # the cache's storage (--kv-dtype) or the compute dtype
    # K and V of one token as the sampler's cache holds them (its layout, an int8 cache's scales included)
    one = jax.eval_shape(lambda: KVCache.init(sampler.cfg, 1, 1, kv_dtype=sampler.kv_dtype, stacked=sampler._scan))
    kv_tok = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((one.k, one.v)))
    kv_mean = B * (P + N / 2) * kv_tok  # the filled cache, averaged over the decode steps
    need = (w + kv_mean) / (args.hbm_gbs * 1e9)
    return {"batch": B, "prompt": P, "new": N, "kv_dtype": kv_dt.name, "prefill_effort": args.prefill_effort,
            "quick_first_prefill": bool(pairs), "quick_prefill_equal": quick_equal,
            "quick_prefill_max_abs_diff": quick_diff, "quick_prefill_argmax_agree": quick_argmax,
            "call_s": s, "first_call_s": first,
            "first_call_programs": programs, "new_tok_s": B * N / s,
            "decode_step_s_upper": s / N, "bytes_weights": w, "bytes_kv_mean": kv_mean, "bandwidth_step_s": need,
            "bandwidth_fraction_upper_bound": need / (s / N), "prefill_call_s": s1, "decode_step_s": step,
            "bandwidth_fraction": need / step,
            "note": "decode_step_s = (call - the prefill-only call) / (N - 1); bandwidth_fraction = the bytes a step "
                    "must read (weights + the mean filled KV cache) at hbm_gbs over it"}


def grpo(P, G, L, N, remat):
    from posttrain import config as C
    from posttrain.data.prompts import Prompt
    from posttrain.train.trainer import place_batch
    from posttrain.trainers import grpo as gm

    cfg = model_config(remat=remat != "none", remat_policy="full" if remat == "none" else remat)
    tmp = tempfile.mkdtemp(prefix="tpu-bench-")
    with open(os.path.join(tmp, "p.jsonl"), "w") as fh:
        fh.write('{"prompt": "hello"}\n')
    gcfg = C.from_dict(gm.GRPOConfig, {
        "model": {"preset": args.preset, "dtype": args.dtype, "remat": remat != "none",
                  "remat_policy": "full" if remat == "none" else remat},
        "data": {"train": os.path.join(tmp, "p.jsonl"), "max_prompt_length": L},
        "grpo": {"num_generations": G, "max_new_tokens": N, "temperature": 1.0, "beta": 0.0,
                 "rewards": {"last_number": 1.0}},
        "rollout": {"dtype": args.rollout_dtype, "is_mode": args.is_mode, "kv_dtype": args.kv_dtype},
        "optim": {"lr": 1e-6, "schedule": "constant", "max_grad_norm": 1.0},
        "train": {"steps": args.steps + 1, "batch_size": P}, "run_dir": os.path.join(tmp, "run")})
    model = build(cfg)
    with mock.patch("posttrain.recipes.rl.build_model", lambda *a, **k: model):  # RLRecipe builds the policy
        trainer = gm.GRPOTrainer(gcfg, progress=False)
    trainer.reward_funcs = [lambda prompts, completions, completion_ids, **_: [
        sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]]
    trainer.reward_weights = [1.0]
    rng = np.random.default_rng(0)
    # a pool of 2,048 prompts, as a real dataset has thousands: grain's index shuffle walks a 2**k domain, so each
    # prompt drawn from a pool of ~40 costs ~1 ms of host time (0.04 ms from 1,000, 0.005 ms from 10**6)
    trainer.prompts = [Prompt(np.asarray([1] + rng.integers(3, cfg.vocab_size, L - 1).tolist(), np.int32), "", {})
                       for _ in range(max(2048, P * (args.steps + 2)))]
    trainer.longest, trainer.length = L, -(-(L + G * N) // 8) * 8  # the prompt bucket and the row
    parts = trainer.setup()
    rollout = parts.batches
    rollout.prompts = trainer.prompts
    import dataclasses
    rollout.params = dataclasses.replace(rollout.params, stop_ids=())
    box, gens, upd, kls, last = [parts.state], [], [], [], []

    def run():
        t = time.perf_counter()
        batch = place_batch(rollout(box[0]))
        t1 = time.perf_counter()
        last[:] = [batch]
        box[0], m = parts.step(box[0], batch)
        jax.block_until_ready(m)
        if "sampling/mismatch_kl" in m:
            kls.append(float(m["sampling/mismatch_kl"]))
        gens.append(rollout.metrics()["time/generate_s"])
        upd.append(time.perf_counter() - t1)
        return t1 - t

    _, first, times = timed(run, args.steps)
    # the steps as train.loop runs them: nothing waits for an update but the next rollout's generate (its tokens
    # come back to the host), so the host's work before the generate overlaps the update on the chip. The steps'
    # mean = the wall time of k steps, the last update's wait included / k (Tunix's figure: the wall time of
    # each of its global steps, in its own loop)
    k, t0 = args.steps + 1, time.perf_counter()
    for _ in range(k):
        box[0], m = parts.step(box[0], place_batch(rollout(box[0])))
    jax.block_until_ready((box[0], m))
    loop_s = (time.perf_counter() - t0) / k
    tokens = P * trainer.length
    u = statistics.median(upd[1:])
    # the state after the last step (the one before it was donated)
    mem = xla_memory(parts.raw_step, box[0], last[0], parts.frozen)
    p = plan(cfg, batch=P, seq_len=trainer.length, mesh_shape={"data": 1}, preset="dp", remat=cfg.remat,
             device_bytes=stat("bytes_limit"))  # XLA fits a step that needs more into the device
    return {"prompts": P, "generations": G, "prompt_len": L, "new": N, "remat": remat, "row_tokens": trainer.length,
            "step_s": statistics.median(times), "loop_step_s": loop_s, "loop_steps": k, "first_step_s": first,
            "generate_s": statistics.median(gens[1:]),
            "update_s": u, "update_tok_s": tokens / u, "step_times": [round(t, 3) for t in times],
            "update_model_flops_s": flops_per_token(cfg, trainer.length) * tokens / u,
            "rollout_dtype": args.rollout_dtype or args.dtype, "is_mode": args.is_mode,
            "kv_dtype": jnp.dtype(parts.batches.sampler.kv_dtype or args.rollout_dtype or args.dtype).name,
            "mismatch_kl": statistics.median(kls) if kls else None, "mismatch_kl_steps": kls,
            "plan": {k: p[k] for k in (*KEYS, "demand", "total", "fitted")}, "xla_memory": mem,
            "plan_over_xla": p["total"] / mem["peak"] if "peak" in mem else None}


def main():
    name, *rest = args.only.split(":")
    conv = [int(x) if x.isdigit() else x for x in rest]
    out = {"section": args.only, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "preset": args.preset, "shape": SHAPE, "dtype": args.dtype,
           "env": {k: v for k, v in os.environ.items() if k.startswith(("JAX_EXEC", "JAX_OPT", "XLA_FLAGS", "LIBTPU"))
                   and v}}
    if name == "peak":
        out.update(peak(*conv))
    elif name in ("sft", "lora"):
        out.update(train(name, *conv))
    elif name == "sample":
        out.update(sample(*conv))
    elif name == "grpo":
        out.update(grpo(*conv))
    else:
        raise SystemExit(f"unknown section {name!r}")
    out["peak_bytes_in_use"] = stat("peak_bytes_in_use")
    out["bytes_limit"] = stat("bytes_limit")
    if "plan" in out and out["peak_bytes_in_use"]:
        out["peak_over_plan"] = out["peak_bytes_in_use"] / out["plan"]["total"]
    for k in ("model_flops_s", "update_model_flops_s"):
        if k in out and args.peak_flops:
            out[k.replace("model_flops_s", "mfu")] = out[k] / args.peak_flops
    if args.profile:
        out["profile_ops"] = profile_ops(args.profile)
    out["wall_s"] = time.perf_counter() - T0
    print(json.dumps(out), flush=True)
    with open(args.jsonl, "a") as fh:
        fh.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()

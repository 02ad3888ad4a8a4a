"""`posttrain` command line: `posttrain {sft,dpo,rm,grpo,plan,export,generate,demo} ...`.

Every user-caused error (PosttrainError) is printed as one line without a traceback and the
process exits with code 2. Subcommands for training arrive with their trainers.
"""

from __future__ import annotations

import argparse
import sys

from posttrain import _xla_defaults  # noqa: F401  (before JAX starts)
from posttrain.errors import PosttrainError


def _generate(args) -> None:
    import jax

    from posttrain.generate import Sampler, SamplingParams
    from posttrain.models import from_pretrained
    from posttrain.tokenizer import Tokenizer

    if not args.prompt.strip():
        raise PosttrainError("--prompt is empty; give the text to continue")
    tok = Tokenizer.from_pretrained(args.model)
    model = from_pretrained(args.model, dtype=args.dtype)
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    else:
        ids = tok.encode(args.prompt)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, n=args.n, stop_ids=tok.eos_ids)
    sampler = Sampler(model, max_len=len(ids) + args.max_new_tokens)
    out = sampler.generate([ids], params, key=jax.random.key(args.seed))
    for i, text in enumerate(out.texts(tok)):
        prefix = f"[{i}] " if args.n > 1 else ""
        print(f"{prefix}{text}")


def _sft(args) -> None:
    from posttrain import config as C
    from posttrain.trainers.sft import SFTTrainer

    result = SFTTrainer(C.load(C.SFTConfig, args.config, args.overrides)).train()
    from posttrain.sharding import is_main_process

    if result.get("finished") or not is_main_process():  # one process reports
        return
    print(f"[sft] done: loss {result['first_loss']:.4f} -> {result['loss']:.4f} in {result['seconds']:.1f} s")


def _dpo(args) -> None:
    from posttrain import config as C
    from posttrain.sharding import is_main_process
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    result = DPOTrainer(C.load(DPOConfig, args.config, args.overrides)).train()
    if result.get("finished") or not is_main_process():
        return
    print(f"[dpo] done: loss {result['first_loss']:.4f} -> {result['loss']:.4f}, reward accuracy "
          f"{result['rewards/accuracies']:.1%} in {result['seconds']:.1f} s")


def _rm(args) -> None:
    from posttrain import config as C
    from posttrain.sharding import is_main_process
    from posttrain.trainers.reward_model import RMConfig, RMTrainer

    result = RMTrainer(C.load(RMConfig, args.config, args.overrides)).train()
    if result.get("finished") or not is_main_process():  # one process reports
        return
    acc = f", held-out accuracy {result['eval_accuracy']:.3f}" if "eval_accuracy" in result else ""
    print(f"[rm] done: loss {result['first_loss']:.4f} -> {result['loss']:.4f}{acc} in {result['seconds']:.1f} s")


def _grpo(args) -> None:
    from posttrain import config as C
    from posttrain.sharding import is_main_process
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    result = GRPOTrainer(C.load(GRPOConfig, args.config, args.overrides)).train()
    if result.get("finished") or not is_main_process():
        return
    print(f"[grpo] done: {result['step']} steps, reward {result.get('reward/mean', float('nan')):.3f} in "
          f"{result['seconds']:.1f} s")


def _plan(args) -> None:
    import math

    from posttrain import config as C
    from posttrain import sharding as sh
    from posttrain.models import load_config
    from posttrain.plan import format_plan
    from posttrain.trainers.sft import build_tokenizer, memory_plan, preset_config, run_config_class

    cfg = C.load(run_config_class(args.config), args.config, args.overrides)
    mc = cfg.model
    if mc.path:  # the same ModelConfig the trainer builds
        model_cfg = load_config(mc.path).replace(param_dtype=mc.dtype, dtype=mc.compute_dtype or mc.dtype)
    else:
        model_cfg = preset_config(mc, build_tokenizer(mc))
    shape = dict(cfg.sharding.mesh_shape) if cfg.sharding.mesh_shape else None
    if cfg.sharding.preset is None:
        n = 1
    elif args.devices:
        n = args.devices
    elif shape and -1 not in shape.values():
        n = math.prod(shape.values())  # a plan for the mesh the config names
    else:
        import jax

        n = jax.device_count()
    mesh_shape = dict(zip(sh.MESH_AXES, sh.mesh_dims(cfg.sharding.preset or "dp", n, shape)))
    device_bytes = int(args.device_memory * 2**30) if args.device_memory else None
    print(format_plan(memory_plan(cfg, model_cfg, mesh_shape), device_bytes))


def _export(args) -> None:
    from posttrain.trainers.sft import export_run

    print(f"exported to {export_run(args.run, args.out, dtype=args.dtype)}")


def _demo(args) -> None:
    from posttrain.tasks import demo

    demo.run(out_dir=args.out, steps=args.steps)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="posttrain", description="Post-training of language models in JAX.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="sample continuations from a Hugging Face checkpoint folder")
    g.add_argument("--model", required=True, help="local HF checkpoint folder (config.json, safetensors, tokenizer)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--n", type=int, default=1, help="samples (the prompt is prefilled once)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="float32", help="parameter dtype: float32 | bfloat16")
    g.set_defaults(func=_generate)
    s = sub.add_parser("sft", help="supervised fine-tuning (full or LoRA) from a YAML config")
    s.add_argument("--config", required=True, help="YAML file, e.g. configs/sft_tiny.yaml")
    s.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-5 train.steps=100")
    s.set_defaults(func=_sft)
    s.add_argument("--distributed", action="store_true",
                   help="multi-process run: jax.distributed from the environment (JAX_COORDINATOR_ADDRESS, "
                        "JAX_NUM_PROCESSES, JAX_PROCESS_ID; Slurm and TPU pods detected)")
    for name, helptext, fn in (("dpo", "direct preference optimisation (DPO family) from a YAML config", _dpo),
                               ("rm", "reward model: a score head trained Bradley-Terry from a YAML config", _rm),
                               ("grpo", "GRPO-family RL with reward functions from a YAML config", _grpo)):
        t = sub.add_parser(name, help=helptext)
        t.add_argument("--config", required=True, help=f"YAML file, e.g. configs/{name}_tiny.yaml")
        t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. dpo.beta=0.05 train.steps=100")
        t.add_argument("--distributed", action="store_true", help="multi-process run, as for `posttrain sft`")
        t.set_defaults(func=fn)
    p = sub.add_parser("plan", help="per-device memory of a training config (parameters, optimizer, ...)")
    p.add_argument("--config", required=True, help="YAML file of a training run")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as for `posttrain sft`")
    p.add_argument("--devices", type=int, default=None, help="devices to plan for (default: the visible ones)")
    p.add_argument("--device-memory", type=float, default=None, help="GiB per device; warn when the plan exceeds it")
    p.set_defaults(func=_plan)
    e = sub.add_parser("export", help="write a finished run as a Hugging Face folder (LoRA merged)")
    e.add_argument("--run", required=True, help="run folder written by `posttrain sft`, `dpo` or `rm`")
    e.add_argument("--out", required=True, help="output Hugging Face folder")
    e.add_argument("--dtype", default=None, help="weights dtype of the export (default: the run's)")
    e.set_defaults(func=_export)
    d = sub.add_parser("demo", help="run the built-in demo job on a tiny local model")
    d.add_argument("--out", default="runs/demo", help="output folder")
    d.add_argument("--steps", type=int, default=1500, help="SFT steps")
    d.set_defaults(func=_demo)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "distributed", False):
            from posttrain.sharding import init_distributed

            init_distributed(auto=True)  # before any other JAX call
        args.func(args)
    except PosttrainError as e:
        print(f"posttrain: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

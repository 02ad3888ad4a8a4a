"""`posttrain` command line:
`posttrain {sft,dpo,rm,grpo,ppo,distill,...,run,plan,export,convert,report,schema,generate,eval,compare,demo} ...`.

Every user-caused error (PosttrainError) is printed as one line without a traceback and the
process exits with code 2. Subcommands for training arrive with their trainers.
"""

from __future__ import annotations

import argparse
import errno
import sys

from posttrain import (
    _xla_defaults,  # noqa: F401  (before JAX starts)
    trainers,
)
from posttrain.errors import PosttrainError, RunStopped


def _generate(args) -> None:
    import jax

    from posttrain.generate import Sampler, SamplingParams
    from posttrain.generate.sampling import kv_cache_dtype
    from posttrain.models import from_pretrained
    from posttrain.models.hf import canonical_dtype
    from posttrain.tokenizer import Tokenizer

    if not args.prompt.strip():
        raise PosttrainError("--prompt is empty; give the text to continue")
    dtype = canonical_dtype(args.dtype, "--dtype")  # fp16, bf16, half, ... accepted
    kv_cache_dtype(args.kv_dtype, "--kv-dtype")  # a bad name fails before the model loads
    tok = Tokenizer.from_pretrained(args.model)
    # read before the model loads: a bad file fails fast, naming itself
    if args.image:
        from posttrain.generate.prompt_images import PromptImages

        images = PromptImages(args.model, args.image, tok, text_only=args.text_only)
    else:
        images = None
    model = from_pretrained(args.model, dtype=dtype, text_only=args.text_only)
    text = args.prompt if images is None else images.prompt(args.prompt)
    if args.chat:  # rendered, then tokenised as transformers' processors do (the template writes the specials)
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
    ids = tok.encode(images.expand_text(text) if images else text, add_special_tokens=not args.chat)
    if images is not None:
        ids = images.expand_ids(ids)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, n=args.n, stop_ids=tok.eos_ids)
    sampler = Sampler(model, max_len=len(ids) + args.max_new_tokens, kv_dtype=args.kv_dtype)
    sampler.quick_first_prefill = True  # one call: its prefill compiles at XLA's lowest effort (a TPU's first call)
    out = sampler.generate([ids], params, key=jax.random.key(args.seed),
                           images=None if images is None else [images.inputs])
    for i, text in enumerate(out.texts(tok)):
        prefix = f"[{i}] " if args.n > 1 else ""
        print(f"{prefix}{text}")


def _eval(args) -> None:
    import json
    import os

    from posttrain import config as C
    from posttrain.data.prompts import eval_prompts
    from posttrain.evals import SampledEval, format_table
    from posttrain.rewards.registry import reward_functions
    from posttrain.tokenizer import Tokenizer

    if bool(args.run) == bool(args.model):
        raise PosttrainError("eval takes exactly one of --model HF_DIR or --run RUN_DIR")
    if args.k < 1:
        raise PosttrainError(f"--k must be at least 1 (samples per prompt), got {args.k}")
    names = args.reward or ["math_answer"]
    rewards = C.Rewards(rewards={name: 1.0 for name in names}, format_pattern=args.format_pattern,
                        reward_timeout_s=60.0)
    if args.run:
        from posttrain.runs import trained_model

        tok, model = trained_model(args.run, best=args.best)
    else:
        from posttrain.models import from_pretrained

        if args.best:
            raise PosttrainError("--best needs --run (a run folder's best evaluated checkpoint)")
        tok, model = Tokenizer.from_pretrained(args.model), from_pretrained(args.model)
    prompts = eval_prompts(args.data, tok, max_prompt_length=args.max_prompt_length, limit=args.max_prompts)
    funcs, weights = reward_functions(rewards, tok, prompts, key="eval")
    ev = SampledEval(prompts, tok, funcs, weights, k=args.k, max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, correct_at=args.correct_at,
                     seed=args.seed, prompts_per_call=args.prompts_per_call, reward_timeout_s=60.0)
    summary, seconds = ev.run(model)
    print(f"[eval] {args.run or args.model}{' (best checkpoint)' if args.best else ''}: {len(prompts)} prompts x "
          f"{args.k} samples of {args.data}, temperature {args.temperature}, {seconds:.1f} s")
    print(format_table(summary))
    out = args.out or (os.path.join(args.run, "eval.json") if args.run else None)
    if out:
        record = {"model": args.run or args.model, "best": args.best, "data": args.data, "prompts": len(prompts),
                  "k": args.k, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                  "rewards": names, "correct_at": args.correct_at, "seconds": round(seconds, 3),
                  "metrics": {name: {"value": v, "ci95": list(ci)} for name, (v, ci) in summary.items()}}
        tmp = out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(record, fh, indent=2)
        os.replace(tmp, out)
        print(f"[eval] written to {out}")


def _compare(args) -> None:
    from posttrain.report import compare_runs

    table, png = compare_runs(args.runs, args.out)
    print(table)
    print(f"[compare] plot {png}")


def _done(name, r) -> str:
    """The one line a finished training run prints (its recipe's `done_line`)."""
    return f"[{name}] done: {trainers.recipe_class(name).done_line(r)} in {r['seconds']:.1f} s"


def _train(args) -> None:
    from posttrain import config as C
    from posttrain.sharding import is_main_process

    recipe = trainers.recipe_class(args.command)
    result = recipe(C.load(recipe.config_class, args.config, args.overrides)).train()
    if result.get("finished") or not is_main_process():  # one process reports
        return
    print(_done(args.command, result))


def _plan(args) -> None:
    import math

    from posttrain import config as C
    from posttrain import sharding as sh
    from posttrain.plan import format_plan
    from posttrain.recipes.build import build_tokenizer, memory_plan, model_config
    from posttrain.runs import config_recipe

    recipe = trainers.recipe_class(config_recipe(args.config))
    cfg = C.load(recipe.config_class, args.config, args.overrides)
    mc = cfg.model
    model_cfg = model_config(mc, build_tokenizer(mc))  # the same ModelConfig the trainer builds
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
    seq, kv = recipe.plan_rows(cfg)
    print(format_plan(memory_plan(cfg, model_cfg, mesh_shape, seq_len=seq, kv_cache_tokens=kv), device_bytes))


def _export(args) -> None:
    if args.best and not args.run:
        raise PosttrainError("export --best needs --run RUN_DIR (the run's best evaluated checkpoint)")
    if args.gguf:  # one GGUF file (models/gguf/) instead of a Hugging Face folder
        if args.out or bool(args.run) == bool(args.model):
            raise PosttrainError("export --gguf FILE takes exactly one of --run RUN_DIR or --model HF_DIR, and no "
                                 "--out")
        if args.model:
            from posttrain.runs import export_folder_gguf

            print(f"exported to {export_folder_gguf(args.model, args.gguf, args.gguf_type)}")
        else:
            from posttrain.runs import export_run_gguf

            print(f"exported to {export_run_gguf(args.run, args.gguf, args.gguf_type, best=args.best)}")
        return
    if not args.run or not args.out or args.model:
        raise PosttrainError("export needs --run RUN_DIR and --out HF_DIR (or --gguf FILE with --run or --model)")
    from posttrain.runs import export_run

    print(f"exported to {export_run(args.run, args.out, dtype=args.dtype, overwrite=args.overwrite, best=args.best)}")


def _convert(args) -> None:
    from posttrain.models.gguf import convert

    print(f"converted to {convert(args.gguf, args.out)}")


def _report(args) -> None:
    from posttrain.report import write_report

    print(f"report written to {write_report(args.run_dir)}")


def _run(args) -> None:
    from posttrain.pipeline import Pipeline
    from posttrain.sharding import is_main_process

    out = Pipeline.from_yaml(args.pipeline, args.overrides).run()
    if is_main_process():
        for st in out["stages"]:
            r = st["result"]
            line = _done(st["recipe"], r) if "first_loss" in r or st["recipe"] in ("grpo", "ppo") else \
                f"[{st['recipe']}] done earlier"
            print(f"[pipeline] {st['name']}: {line}; Hugging Face folder {st['hf']}")


def _schema(args) -> None:
    from posttrain.schema import write_schemas

    for path in write_schemas(args.out):
        print(path)


def _demo(args) -> None:
    from posttrain.demos import demo

    demo.run(out_dir=args.out, quick=args.quick)


def build_parser() -> argparse.ArgumentParser:
    from posttrain import __version__

    ap = argparse.ArgumentParser(prog="posttrain", description="Post-training of language models in JAX.")
    ap.add_argument("--version", action="version", version=f"posttrain {__version__}")
    ap.add_argument("--debug", action="store_true",
                    help="on an input error, print its traceback too (give it first: posttrain --debug sft ...)")
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
    g.add_argument("--dtype", default="float32", help="parameter dtype: float32 (fp32) | bfloat16 (bf16) | "
                   "float16 (fp16, half)")
    g.add_argument("--kv-dtype", default=None, help="the KV cache's storage dtype: float8_e4m3fn | float8_e5m2 | int8 "
                   "(half a bfloat16 cache's bytes; int8 with a scale a slot) | bfloat16 | float16 | float32; "
                   "default: the compute dtype")
    g.add_argument("--text-only", action="store_true", help="a multimodal Gemma 4 folder: its text model only")
    g.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for a Qwen3-VL or Gemma 3 folder (repeatable): one per <image> in the prompt, "
                   "or all before the prompt's text when it has none")
    g.set_defaults(func=_generate)
    for name, (_, helptext) in trainers.TRAINERS.items():
        t = sub.add_parser(name, help=helptext)
        t.add_argument("--config", required=True, help=f"YAML file, e.g. configs/{name}_tiny.yaml")
        t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-5 train.steps=100")
        t.add_argument("--distributed", action="store_true",
                       help="multi-process run: jax.distributed from the environment (JAX_COORDINATOR_ADDRESS, "
                            "JAX_NUM_PROCESSES, JAX_PROCESS_ID; Slurm and TPU pods detected)")
        t.set_defaults(func=_train)
    p = sub.add_parser("plan", help="per-device memory of a training config (parameters, optimizer, ...)")
    p.add_argument("--config", required=True, help="YAML file of a training run")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as for `posttrain sft`")
    p.add_argument("--devices", type=int, default=None, help="devices to plan for (default: the visible ones)")
    p.add_argument("--device-memory", type=float, default=None, help="GiB per device; warn when the plan exceeds it")
    p.set_defaults(func=_plan)
    e = sub.add_parser("export", help="write a finished run as a Hugging Face folder (LoRA merged)")
    e.add_argument("--run", default=None, help="run folder written by a posttrain trainer")
    e.add_argument("--out", default=None, help="output Hugging Face folder")
    e.add_argument("--gguf", default=None, help="write one GGUF file (llama.cpp) instead of a folder: from --run, "
                   "or from any Hugging Face folder with --model")
    e.add_argument("--model", default=None, help="with --gguf: a Hugging Face folder posttrain loads")
    e.add_argument("--gguf-type", default="f32", help="GGUF weight type: f32 | f16 | bf16 | q8_0")
    e.add_argument("--dtype", default=None, help="weights dtype of the export (default: the run's): float32 "
                   "(fp32) | bfloat16 (bf16) | float16 (fp16, half)")
    e.add_argument("--overwrite", action="store_true", help="replace an --out folder that holds files export "
                   "did not write (never a run folder)")
    e.add_argument("--best", action="store_true", help="the run's best evaluated checkpoint (checkpoint.best_metric) "
                   "instead of its last step")
    e.set_defaults(func=_export)
    ev = sub.add_parser("eval", help="pass@1, pass@k, maj@k, mean reward and length of k sampled answers per prompt, "
                        "with 95 %% bootstrap intervals")
    ev.add_argument("--model", default=None, help="a Hugging Face folder")
    ev.add_argument("--run", default=None, help="or a run folder (its trained model; the JSON goes into it)")
    ev.add_argument("--best", action="store_true", help="with --run: its best evaluated checkpoint")
    ev.add_argument("--data", required=True, help="prompt rows with their answers (RL prompt rows, or SFT / "
                    "preference rows: the completion / chosen answer is the reference)")
    ev.add_argument("--reward", action="append", help="a built-in reward (math_answer, last_number, countdown, "
                    "code_tests, format, ...) or package.module:function; repeat to sum several (default "
                    "math_answer)")
    ev.add_argument("--format-pattern", default=None, help="the regex of the format reward")
    ev.add_argument("--k", type=int, default=8, help="samples per prompt")
    ev.add_argument("--temperature", type=float, default=1.0)
    ev.add_argument("--top-p", type=float, default=1.0)
    ev.add_argument("--top-k", type=int, default=0)
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--max-prompt-length", type=int, default=1024, help="longer prompts are row errors")
    ev.add_argument("--max-prompts", type=int, default=None, help="the first N prompts only")
    ev.add_argument("--prompts-per-call", type=int, default=64, help="prompts per sampler call")
    ev.add_argument("--correct-at", type=float, default=1.0,
                    help="a sample is correct when its reward is at least this")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--out", default=None, help="JSON file (default: RUN_DIR/eval.json with --run, none with --model)")
    ev.set_defaults(func=_eval)
    cp = sub.add_parser("compare", help="the evaluation metrics of several runs: one table and one PNG against steps")
    cp.add_argument("runs", nargs="+", help="run folders (metrics.jsonl)")
    cp.add_argument("--out", default="compare.png", help="the PNG file")
    cp.set_defaults(func=_compare)
    cv = sub.add_parser("convert", help="a GGUF file (llama.cpp) as a Hugging Face folder (dequantized to float32)")
    cv.add_argument("--gguf", required=True, help="the .gguf file (llama or qwen2 architecture)")
    cv.add_argument("--out", required=True, help="output Hugging Face folder")
    cv.set_defaults(func=_convert)
    r = sub.add_parser("report", help="PNG plots + one self-contained HTML page of a run folder's metrics")
    r.add_argument("run_dir", help="run folder written by a posttrain trainer (config.yaml, metrics.jsonl)")
    r.set_defaults(func=_report)
    pr = sub.add_parser("run", help="a pipeline file: a chain of training stages (each stage's model the next "
                        "one's input)")
    pr.add_argument("pipeline", help="YAML file with run_dir, model, sharding, defaults and stages, e.g. "
                    "configs/pipeline_tiny.yaml")
    pr.add_argument("overrides", nargs="*", help="dotted overrides: run_dir=..., model.path=..., or "
                    "STAGE.section.key=value, e.g. sft.train.steps=100")
    pr.add_argument("--distributed", action="store_true", help="multi-process run, as for the trainers")
    pr.set_defaults(func=_run)
    sc = sub.add_parser("schema", help="JSON Schemas of every trainer's config and of pipeline files (for editors)")
    sc.add_argument("--out", default="schemas", help="output folder (one <recipe>.schema.json each)")
    sc.set_defaults(func=_schema)
    d = sub.add_parser("demo", help="run the built-in demo job on a tiny local model")
    d.add_argument("--out", default="runs/demo", help="output folder")
    d.add_argument("--quick", action="store_true", help="tiny step counts: the same stages in about a minute")
    d.set_defaults(func=_demo)
    return ap


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk or quota, a file-size limit


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.func in (_generate, _train, _eval, _run, _demo):  # the commands that compile
            from posttrain import compile_cache

            compile_cache.enable()  # before the first compilation
        if getattr(args, "distributed", False):
            from posttrain.sharding import init_distributed

            init_distributed(auto=True)  # before any other JAX call
        args.func(args)
    except RunStopped as e:  # SIGTERM / Ctrl-C during training: checkpointed, resumable
        import signal

        print(f"posttrain: {e}", file=sys.stderr)
        return 128 + int(getattr(signal, e.why))
    except (PosttrainError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in _DISK_FULL:
            raise
        if args.debug:  # where it was raised, for a bug report; without --debug the message alone
            import traceback

            traceback.print_exc()
        if isinstance(e, OSError):
            e = (f"could not write {e.filename or 'a file'}: {e.strerror}; free disk space and run the same command "
                 "again (a training run resumes from its last checkpoint)")
        print(f"posttrain: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

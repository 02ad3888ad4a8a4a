"""`posttrain demo`: the main job on a built-in task, from scratch, on a CPU in a few minutes.

What it is: four stages on two-digit addition (`tasks/addition.py`, prompt/completion rows from a
seed, a held-out split never seen in training), each a normal trainer run in `<out>/<stage>/`
exported to `<out>/<stage>/hf` (a Hugging Face folder), each scored by greedy exact-match
accuracy of that exported folder on the held-out questions:
  1. sft      a tiny Llama-architecture model (byte tokenizer, random init) SFT-ed to partial accuracy;
  2. grpo     LoRA GRPO from the SFT export, the task's verifier (`last_number`) as the reward;
  3. dpo      LoRA DPO from the GRPO export on pairs built from the GRPO model's own samples
              (chosen = a right sample, rejected = a wrong one of the same prompt);
  4. distill  the DPO model distilled (offline logits) into a smaller student (demo-student: 2 of 3 layers);
              its held-out KL(teacher||student) is reported too.
One line after each stage, then a table; `<out>/summary.json` (per stage: name, accuracy as a
fraction, KL for the student, wall seconds; the total) and one report page, `<out>/report/report.html`
(the stage table, every stage's evaluation curves: the GRPO stage's pass@1 / pass@8 / maj@8 of 8
samples per held-out question every 10 steps, the student's KL; and the student's greedy answers).
The GRPO stage keeps its best pass@1 checkpoint: `posttrain export --run <out>/grpo --best`.
`quick=True` runs the same path with tiny step counts on a subset of the rows (the test). No downloads.

What it is not: a benchmark (the numbers vary a little with the machine's float round-off).
"""

from __future__ import annotations

import json
import shutil
import time

import jax

from posttrain import config as C
from posttrain.tasks import addition

# Step counts and sizes. FULL is `make demo` (about 5 minutes on 2 idle CPU cores, 9 on busy ones); QUICK
# is the test (the same stages on a 512-row subset with a few steps each, compilation dominates).
FULL = dict(train_rows=None, sft_steps=250, grpo_steps=40, grpo_batch=16, generations=8, dpo_prompts=512,
            dpo_samples=8, dpo_steps=30, dpo_batch=16, distill_steps=800, distill_batch=64, eval_prompts=200)
QUICK = dict(train_rows=512, sft_steps=4, grpo_steps=2, grpo_batch=4, generations=4, dpo_prompts=16,
             dpo_samples=4, dpo_steps=2, dpo_batch=4, distill_steps=2, distill_batch=8, eval_prompts=16)


def _common(run_dir: str, steps: int, batch: int, log_every: int, eval_every: int = 0) -> dict:
    every = lambda n: max(1, min(n, steps)) if n else 0  # noqa: E731
    return {"train": {"steps": steps, "batch_size": batch, "log_every": every(log_every),
                      "eval_every": every(eval_every)},
            "run_dir": run_dir}


def sft_stage(out: str, s: dict, progress: bool):
    from posttrain.trainers.sft import SFTTrainer

    cfg = C.from_dict(C.SFTConfig, {
        "model": {"preset": "demo-tiny", "seed": 0},
        "data": {"train": f"{out}/data/train.jsonl", "max_length": 16},
        "optim": {"lr": 1.5e-3, "warmup_steps": 20, "schedule": "constant", "weight_decay": 0.01},
        **_common(f"{out}/sft", s["sft_steps"], 64, 50)}, where="demo sft")
    return SFTTrainer(cfg, progress=progress).train()


def grpo_stage(out: str, s: dict, progress: bool, run_dir: str | None = None, **sections):
    """The GRPO stage; `run_dir` and extra config `sections` (e.g. rollout={...}) for variants of it."""
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    cfg = C.from_dict(GRPOConfig, {**{
        "model": {"path": f"{out}/sft/hf"},
        "data": {"train": f"{out}/data/prompts.jsonl", "eval": f"{out}/data/eval.jsonl", "max_prompt_length": 8},
        "grpo": {"num_generations": s["generations"], "max_new_tokens": 4, "rewards": {"last_number": 1.0}},
        "lora": {"enabled": True, "rank": 8},
        "optim": {"lr": 1e-3, "schedule": "constant"},
        # pass@1 / pass@8 / maj@8 of 8 samples (temperature 1) per held-out question every 10 steps; the best
        # pass@1 step is kept (`posttrain export --run <out>/grpo --best`)
        "eval": {"k": 8, "max_prompts": s["eval_prompts"]},
        "checkpoint": {"best_metric": "eval_pass@1"},
        **_common(run_dir or f"{out}/grpo", s["grpo_steps"], s["grpo_batch"], 10, eval_every=10)}, **sections},
        where="demo grpo")
    return GRPOTrainer(cfg, progress=progress).train()


def preference_pairs(model, tok, rows, k: int, seed: int = 0, min_pairs: int = 1) -> tuple[list[dict], int]:
    """(TRL preference rows, how many are self-generated): k samples (temperature 1) per prompt; a
    prompt with a right and a wrong sample gives {"prompt", "chosen": right, "rejected": wrong}.
    Fewer than `min_pairs` (a model that is never right, e.g. the quick demo's): prompts with only
    wrong samples are added with the reference answer as chosen."""
    from posttrain.generate import Sampler, SamplingParams

    ids = [tok.encode(r["prompt"]) for r in rows]
    sampler = Sampler(model, max_len=max(map(len, ids)) + 8, pad_id=tok.pad_id)
    out = sampler.generate(ids, SamplingParams(max_new_tokens=4, temperature=1.0, n=k, stop_ids=tok.eos_ids),
                           key=jax.random.key(seed))
    texts = [t.strip() for t in out.texts(tok)]
    mixed, wrong_only = [], []
    for i, r in enumerate(rows):
        group = texts[i * k:(i + 1) * k]
        right = [t for t in group if t == r["completion"]]
        wrong = [t for t in group if t != r["completion"] and t]  # an empty answer is not a valid pair
        if right and wrong:
            mixed.append({"prompt": r["prompt"], "chosen": right[0], "rejected": wrong[0]})
        elif wrong:
            wrong_only.append({"prompt": r["prompt"], "chosen": r["completion"], "rejected": wrong[0]})
    return mixed + wrong_only[:max(0, min_pairs - len(mixed))], len(mixed)


def dpo_stage(out: str, s: dict, progress: bool):
    from posttrain.models import from_pretrained
    from posttrain.tokenizer import Tokenizer
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    rows = addition.make_pairs(digits=2, seed=0, n_eval=200)[0][:s["dpo_prompts"]]
    pairs, mixed = preference_pairs(from_pretrained(f"{out}/grpo/hf"), Tokenizer.from_pretrained(f"{out}/grpo/hf"),
                                    rows, s["dpo_samples"], min_pairs=s["dpo_batch"])
    addition.write_jsonl(pairs, f"{out}/data/pairs.jsonl")
    print(f"[demo] {len(pairs)} preference pairs from {len(rows)} prompts x {s['dpo_samples']} samples of the GRPO "
          f"model ({mixed} with a right and a wrong sample"
          + (f", {len(pairs) - mixed} with the reference answer as chosen)" if len(pairs) > mixed else ")"))
    cfg = C.from_dict(DPOConfig, {
        "model": {"path": f"{out}/grpo/hf"},
        "data": {"train": f"{out}/data/pairs.jsonl", "max_length": 24, "truncation": "drop"},
        "dpo": {"beta": 0.1},
        "lora": {"enabled": True, "rank": 8},
        "optim": {"lr": 2e-4, "warmup_steps": 5, "schedule": "cosine"},  # 5e-4 lost greedy accuracy; 1e-4-2e-4 gain
        **_common(f"{out}/dpo", s["dpo_steps"], s["dpo_batch"], 10)}, where="demo dpo")
    return DPOTrainer(cfg, progress=progress).train()


def distill_stage(out: str, s: dict, progress: bool):
    from posttrain.trainers.distill import DistillConfig, DistillTrainer

    cfg = C.from_dict(DistillConfig, {
        "model": {"preset": "demo-student", "tokenizer": f"{out}/dpo/hf"},
        "teacher": {"path": f"{out}/dpo/hf"},
        "data": {"train": f"{out}/data/train.jsonl", "eval": f"{out}/data/eval.jsonl", "max_length": 16},
        "distill": {"alpha": 0.9, "temperature": 1.0},  # mostly the teacher's distribution, as it is
        # tiny-student (half the width) reached 9.5 % in 400 steps at lr 3e-3; demo-student 6.5 % at 400 steps,
        # 66 % at 800 steps and lr 1.5e-3 (teacher 63.5 %)
        "optim": {"lr": 1.5e-3, "warmup_steps": 20, "schedule": "cosine", "min_lr_ratio": 0.1},
        **_common(f"{out}/distill", s["distill_steps"], s["distill_batch"], 50)}, where="demo distill")
    return DistillTrainer(cfg, progress=progress).train()


STAGES = (("sft", sft_stage), ("grpo", grpo_stage), ("dpo", dpo_stage), ("distill", distill_stage))


def table(rows: list[dict]) -> str:
    lines = [f"{'stage':<8} | {'held-out accuracy':>17} | {'KL':>7} | {'seconds':>7}"]
    lines.append("-" * len(lines[0]))
    for r in rows:
        kl = "-" if r["kl"] is None else f"{r['kl']:.4f}"
        lines.append(f"{r['stage']:<8} | {r['accuracy']:>17.1%} | {kl:>7} | {r['seconds']:>7.1f}")
    return "\n".join(lines)


class Greedy:
    """Greedy answers to the held-out questions; one compiled sampler per model shape (the SFT, GRPO and
    DPO exports share demo-tiny's, so their evaluations compile once)."""

    def __init__(self, tok, prompts: list[str]):
        self.tok, self.ids, self.sampler = tok, [tok.encode(p) for p in prompts], None

    def __call__(self, model) -> list[str]:
        from posttrain.generate import Sampler, SamplingParams

        if self.sampler is not None and self.sampler.cfg == model.cfg:
            self.sampler.update(model)
        else:
            self.sampler = Sampler(model, max_len=max(map(len, self.ids)) + 8, pad_id=self.tok.pad_id)
        params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_ids=self.tok.eos_ids)
        return self.sampler.generate(self.ids, params).texts(self.tok)


def device_name() -> str:
    """The device the stages ran on, as the summary names it: e.g. "cpu (1 device)", "TPU v5 lite (1 device)"."""
    import jax

    devs = jax.devices()
    kind = "cpu" if devs[0].platform == "cpu" else devs[0].device_kind
    return f"{kind} ({len(devs)} device{'s' if len(devs) > 1 else ''})"


def run(out_dir: str = "runs/demo", progress: bool = True, quick: bool = False) -> dict:
    """Run the four stages into `out_dir` (each stage's folder starts fresh); returns the summary.

    On a TPU the float32 matmuls run at full precision ("highest") for the whole demo: the chip's default passes
    float32 operands through bfloat16, which took the held-out accuracies from 31.0 / 55.5 / 58.5 / 63.5 % to
    15.0 / 28.0 / 33.5 / 39.5 % (docs/benchmarks.md). A CPU's matmuls are float32 either way; nothing changes there.
    """
    if jax.default_backend() != "tpu":
        return _run(out_dir, progress, quick)
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        return _run(out_dir, progress, quick)
    finally:
        jax.config.update("jax_default_matmul_precision", before)


def _run(out_dir: str, progress: bool, quick: bool) -> dict:
    from posttrain.models import from_pretrained
    from posttrain.report import write_pipeline_report
    from posttrain.runs import export_run
    from posttrain.tokenizer import byte_tokenizer

    t_start, s, out = time.perf_counter(), QUICK if quick else FULL, out_dir
    train, evals = addition.make_pairs(digits=2, seed=0, n_eval=200)
    train = train[:s["train_rows"]]
    addition.write_jsonl(train, f"{out}/data/train.jsonl")
    addition.write_jsonl(evals, f"{out}/data/eval.jsonl")
    addition.write_jsonl([{"prompt": r["prompt"], "answer": r["completion"]} for r in train],
                         f"{out}/data/prompts.jsonl")
    greedy = Greedy(byte_tokenizer(), [r["prompt"] for r in evals])
    device = device_name()
    print(f"[demo] two-digit addition: {len(train)} training rows, {len(evals)} held-out questions, on {device}"
          + (" (quick: tiny step counts)" if quick else ""))
    rows = []
    for name, stage in STAGES:
        t0 = time.perf_counter()
        shutil.rmtree(f"{out}/{name}", ignore_errors=True)  # the demo's own folders: start fresh each time
        result = stage(out, s, progress)
        hf = export_run(f"{out}/{name}", f"{out}/{name}/hf")
        texts = greedy(from_pretrained(hf))  # the exported folder is what gets scored
        acc = sum(t.strip() == r["completion"] for t, r in zip(texts, evals)) / len(evals)
        kl = float(result["eval_teacher_kl"]) if name == "distill" else None
        rows.append({"stage": name, "accuracy": acc, "kl": kl, "seconds": round(time.perf_counter() - t0, 1)})
        print(f"[demo] {name}: held-out accuracy {acc:.1%}"
              + (f", KL(teacher||student) {kl:.4f}" if kl is not None else "")
              + f", {rows[-1]['seconds']:.0f} s, Hugging Face folder {hf}")
    samples = [{"prompt": r["prompt"], "completion": t} for r, t in zip(evals[:8], texts)]  # the student's
    report = write_pipeline_report(out, [(name, f"{out}/{name}") for name, _ in STAGES], stages=rows, samples=samples)
    summary = {"stages": rows, "total_seconds": round(time.perf_counter() - t_start, 1), "device": device}
    with open(f"{out}/summary.json", "w") as fh:
        json.dump(summary, fh, indent=2)
    print("\n" + table(rows) + f"\n\n[demo] total {summary['total_seconds']:.0f} s on {device}; "
          f"summary {out}/summary.json; report {report}")
    return summary

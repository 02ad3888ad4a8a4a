"""The tool-use learning recipe's first half: the task's data and a tiny model that calls the calculator sometimes.

What it is:
- `write_data(out, ...)`: `tool_arithmetic` rows (`tasks/tool_arithmetic.py`) as `<out>/data/prompts.jsonl` (training
  prompts for `posttrain grpo` with `env.enabled`) and `<out>/data/eval.jsonl` (held-out problems).
- `sft_rows(rows, tool_fraction=...)`: SFT episodes as rows of the SFT recipe's "segments" format
  (`data/formats.py`): a fraction of the rows as the demonstration with the calculator
  (`task.demonstration`: the prompt, the call, the calculator's real output, the answer), the others
  answered directly (`#### <answer>`: the model guesses, as a tiny model without a tool must). Only the
  model's own text is labelled (trained): never the prompt, never the tool output; each ends in EOS.
- `sft_start(out, rows, steps=...)`: those rows as `<out>/sft/data.jsonl`, trained by the SFT recipe
  (`trainers/sft.py`, as `posttrain sft` would: demo-tiny with the byte tokenizer from scratch, packed
  rows) in the run folder `<out>/sft`, exported as a Hugging Face folder `<out>/sft/hf`: a start that
  writes a well-formed call for some problems and guesses for the others, which GRPO with the
  calculator improves on.
- `prepare(out, quick=...)`: both, the start of `configs/grpo_agentic.yaml` and of
  `benchmarks/agentic.py` (the full recipe: before / after accuracy and tool-use rate).

What it is not: a training loop of its own (the SFT and GRPO recipes train; this writes their data and
configs).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Sequence

from posttrain.tasks import tool_arithmetic as task

DATA = dict(difficulty=2, seed=0, n_train=2000, n_eval=200)  # 3-digit products: the calculator is needed


def write_data(out: str, *, difficulty=2, seed: int = 0, n_train: int = 2000, n_eval: int = 200) -> task.ToolTaskData:
    """`<out>/data/prompts.jsonl` (training rows) and `<out>/data/eval.jsonl` (held-out rows)."""
    data = task.make(difficulty, seed=seed, n_train=n_train, n_eval=n_eval)
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    for name, rows in (("prompts", data.prompts), ("eval", data.eval_prompts)):
        with open(os.path.join(out, "data", f"{name}.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    return data


def sft_rows(rows: Sequence[dict], *, tool_fraction: float, seed: int = 0, fmt: str = "hermes") -> list[dict]:
    """One SFT row in the "segments" format (`data/formats.py`) per task row: the calculator demonstration
    for a `tool_fraction` of the rows (prompt, call, tool output, answer), a direct answer for the rest
    (prompt, answer); `"label": true` on the model's own text only (the call and the answer)."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        if rng.random() < tool_fraction:
            segments = task.demonstration(row, fmt=fmt)
        else:
            segments = [(row["prompt"], False), (task.ANSWER.format(answer=row["answer"]), True)]
        out.append({"segments": [{"text": text, "label": bool(label)} for text, label in segments]})
    return out


def sft_start(out: str, rows: Sequence[dict], *, steps: int, tool_fraction: float = 0.5, lr: float = 3e-3,
              batch_size: int = 16, seed: int = 0, preset: str = "demo-tiny", log_every: int = 0) -> str:
    """`sft_rows(rows)` written to `<out>/sft/data.jsonl` and trained with the SFT recipe (`posttrain sft`):
    `preset` from scratch with the byte tokenizer, `steps` AdamW steps (warm-up, cosine decay to lr / 10)
    on packed rows of `batch_size`; the run in `<out>/sft` (started afresh), exported to the HF folder
    `<out>/sft/hf`, which it returns. (Copying the expression into the call and the calculator's output
    into the answer appears abruptly, after ~600 steps at these settings.)"""
    from posttrain import config as C
    from posttrain.data import tokenize_row
    from posttrain.runs import export_run
    from posttrain.tokenizer import byte_tokenizer
    from posttrain.trainers.sft import SFTTrainer

    run_dir = os.path.join(out, "sft")
    shutil.rmtree(run_dir, ignore_errors=True)  # the recipe's own folder: a fresh start each time, as before
    os.makedirs(run_dir)
    episodes = sft_rows(rows, tool_fraction=tool_fraction, seed=seed)
    path = os.path.join(run_dir, "data.jsonl")
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in episodes)
    tok = byte_tokenizer()
    longest = max(len(tokenize_row(r, path, tok)[0]) for r in episodes)
    cfg = C.from_dict(C.SFTConfig, {
        "model": {"preset": preset, "seed": seed},  # the byte tokenizer sizes the vocabulary
        "data": {"train": path, "max_length": -(-longest // 16) * 16, "packing": True, "seed": seed},
        "optim": {"lr": lr, "warmup_steps": min(20, steps // 4), "schedule": "cosine", "min_lr_ratio": 0.1},
        "train": {"steps": steps, "batch_size": min(batch_size, len(episodes)), "log_every": log_every},
        "run_dir": run_dir}, where="agentic sft")
    SFTTrainer(cfg, progress=False).train()
    return export_run(run_dir, os.path.join(run_dir, "hf"))


QUICK = dict(n_train=64, n_eval=16, sft_steps=4)
FULL = dict(n_train=2000, n_eval=200, sft_steps=1000)


def prepare(out: str = "runs/agentic", *, quick: bool = False, tool_fraction: float = 0.5, seed: int = 0,
            sft_steps: int | None = None) -> dict:
    """The data and the SFT start in `out` (what configs/grpo_agentic.yaml reads); `quick`: a few rows
    and steps (the docs test). Returns {"data", "model"} (a ToolTaskData and the HF folder)."""
    s = QUICK if quick else FULL
    data = write_data(out, difficulty=DATA["difficulty"], seed=seed, n_train=s["n_train"], n_eval=s["n_eval"])
    hf = sft_start(out, data.prompts, steps=sft_steps or s["sft_steps"], tool_fraction=tool_fraction, seed=seed,
                   log_every=0 if quick else 100)
    return {"data": data, "model": hf}

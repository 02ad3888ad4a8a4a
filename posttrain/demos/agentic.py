"""The tool-use learning recipe's first half: the task's data and a tiny model that calls the calculator sometimes.

What it is:
- `write_data(out, ...)`: `tool_arithmetic` rows (`tasks/tool_arithmetic.py`) as `<out>/data/prompts.jsonl` (training
  prompts for `posttrain grpo` with `env.enabled`) and `<out>/data/eval.jsonl` (held-out problems).
- `sft_examples(rows, tok, tool_fraction=...)`: SFT episodes as (ids, loss mask): a fraction of the
  rows as the demonstration with the calculator (`task.demonstration`: the call, the calculator's
  real output, the answer), the others answered directly (`#### <answer>`: the model guesses, as a
  tiny model without a tool must), each ending in EOS. The mask is 1 on the model's own tokens
  only: never on the prompt, never on the tool output (`env.encode_segments`).
- `sft_start(out, rows, steps=...)`: demo-tiny (byte tokenizer) from scratch, `steps` AdamW steps on
  those episodes (packed rows), saved as a Hugging Face folder `<out>/sft/hf`: a start that writes a
  well-formed call for some problems and guesses for the others, which GRPO with the calculator
  improves on.
- `prepare(out, quick=...)`: both, the start of `configs/grpo_agentic.yaml` and of
  `benchmarks/agentic.py` (the full recipe: before / after accuracy and tool-use rate).

What it is not: a general SFT trainer (`posttrain sft` trains on TRL formats; these episodes carry
an untrained tool output in the middle, so the recipe builds its batches itself, as the tests do).
"""

from __future__ import annotations

import json
import os
import random
from typing import Sequence

import numpy as np

from posttrain.agentic.env import encode_segments
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


def sft_examples(rows: Sequence[dict], tok, *, tool_fraction: float, seed: int = 0,
                 fmt: str = "hermes") -> list[tuple[list[int], list[int]]]:
    """(ids, mask) per row: the calculator demonstration for a `tool_fraction` of the rows, a direct
    answer for the rest; ids start with the prompt as `tok.encode` gives it (BOS) and end in EOS."""
    rng = random.Random(seed)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    out = []
    for row in rows:
        if rng.random() < tool_fraction:
            segments = task.demonstration(row, fmt=fmt)[1:]
        else:
            segments = [(task.ANSWER.format(answer=row["answer"]), True)]
        prompt = tok.encode(row["prompt"])
        ids, mask = encode_segments(segments, enc)
        out.append((prompt + ids + [tok.eos_id], [0] * len(prompt) + mask + [1]))
    return out


def sft_batches(examples, *, batch_size: int, seed: int = 0, pad_id: int = 0, open_rows: int = 8):
    """Endless shuffled batches (tokens, positions, segment_ids, targets, weights) of the examples, packed:
    each row holds as many examples as fit (first fit over the last `open_rows` rows; each example its own
    segment, positions from 0), so short direct answers share rows and every batch mixes both kinds. The
    weight of position t is the mask of token t + 1 (the token it predicts, inside the same example)."""
    L = -(-max(len(ids) for ids, _ in examples) // 16) * 16
    rng = np.random.default_rng(seed)
    while True:
        rows, room = [], []
        for i in rng.permutation(len(examples)):
            n = len(examples[i][0])
            k = next((k for k in range(max(0, len(rows) - open_rows), len(rows)) if room[k] >= n), None)
            if k is None:
                rows.append([])
                room.append(L)
                k = len(rows) - 1
            rows[k].append(i)
            room[k] -= n
        rows = [rows[k] for k in rng.permutation(len(rows))]
        for start in range(0, max(1, len(rows) - batch_size + 1), batch_size):
            chunk = rows[start:start + batch_size]
            b = {f: np.zeros((len(chunk), L), np.int32) for f in ("tokens", "positions", "segment_ids", "targets")}
            b["tokens"][:] = pad_id
            b["weights"] = np.zeros((len(chunk), L), np.float32)
            for r, members in enumerate(chunk):
                at = 0
                for seg, i in enumerate(members, start=1):
                    ids, mask = examples[i]
                    n, end = len(ids), at + len(ids)
                    b["tokens"][r, at:end], b["positions"][r, at:end] = ids, np.arange(n)
                    b["segment_ids"][r, at:end] = seg
                    b["targets"][r, at:end - 1], b["weights"][r, at:end - 1] = ids[1:], mask[1:]
                    at = end
            yield b


def sft_start(out: str, rows: Sequence[dict], *, steps: int, tool_fraction: float = 0.5, lr: float = 3e-3,
              batch_size: int = 16, seed: int = 0, preset: str = "demo-tiny", log_every: int = 0) -> str:
    """demo-tiny from scratch, `steps` AdamW steps (warm-up, cosine decay to lr / 10) on packed rows of
    `sft_examples(rows)`; returns the HF folder `<out>/sft/hf`. (Copying the expression into the call
    and the calculator's output into the answer appears abruptly, after ~600 steps at these settings.)"""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from posttrain import config as C
    from posttrain.losses import sft_loss
    from posttrain.models import Transformer, save_pretrained
    from posttrain.models import preset as model_preset
    from posttrain.tokenizer import byte_tokenizer
    from posttrain.train import init_state, make_optimizer, make_train_step, merge, schedule

    tok = byte_tokenizer()
    examples = sft_examples(rows, tok, tool_fraction=tool_fraction, seed=seed)
    optim = C.OptimSection(lr=lr, warmup_steps=min(20, steps // 4), schedule="cosine", min_lr_ratio=0.1)
    opt = make_optimizer(optim, schedule(optim, steps))
    cfg = model_preset(preset, vocab_size=tok.vocab_size)
    make = lambda: Transformer(cfg, rngs=nnx.Rngs(seed))  # noqa: E731
    # initialised in one jitted call (op-by-op initialisation compiles every small op on its own)
    model = nnx.merge(nnx.split(nnx.eval_shape(make))[0], jax.jit(lambda: nnx.split(make())[1])())
    graphdef, state = init_state(model, opt)
    step = make_train_step(sft_loss, opt, graphdef)
    data = sft_batches(examples, batch_size=min(batch_size, len(examples)), seed=seed, pad_id=tok.pad_id)
    for i in range(1, steps + 1):
        state, metrics = step(state, {k: jnp.asarray(v) for k, v in next(data).items()})
        if log_every and (i % log_every == 0 or i == steps):
            print(f"[sft] step {i}: loss {float(metrics['loss']):.4f}", flush=True)
    return save_pretrained(merge(graphdef, state), os.path.join(out, "sft", "hf"), tokenizer=tok)


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

"""A synthetic preference set with a hidden, learnable rule (reward-model and DPO tests).

Rule: the preferred review of the prompt's subject uses MORE positive words. Each answer is
three words from POSITIVE / NEGATIVE (order shuffled); the chosen answer has 2 or 3 positive
words, the rejected one 0 or 1. `margin` = 0.5 * (positives(chosen) - positives(rejected) - 1)
(0, 0.5 or 1: a larger gap is a clearer preference, Llama 2's margin). Rows are TRL's standard
explicit-prompt format: {"prompt", "chosen", "rejected", "margin"}; with the byte tokenizer a
row is under 30 prompt + 24 answer tokens.

    python tests/pref_data.py    # rewrites tests/data/pref_tiny.jsonl (40) and pref_tiny_eval.jsonl (16)
"""

from __future__ import annotations

import json
import os
import random

POSITIVE = ("great", "lovely", "superb", "fine", "neat", "kind", "warm", "bright")
NEGATIVE = ("awful", "dull", "rude", "grim", "cold", "harsh", "bleak", "sour")
SUBJECTS = ("film", "soup", "hotel", "book", "trip", "song", "park", "class", "cafe", "game")


def _answer(rng: random.Random, positives: int) -> str:
    words = rng.sample(POSITIVE, positives) + rng.sample(NEGATIVE, 3 - positives)
    rng.shuffle(words)
    return " " + ", ".join(words) + "."


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        kc, kr = rng.choice((2, 3)), rng.choice((0, 1))
        rows.append({"prompt": f"Review the {rng.choice(SUBJECTS)}:", "chosen": _answer(rng, kc),
                     "rejected": _answer(rng, kr), "margin": 0.5 * (kc - kr - 1)})
    return rows


def write_jsonl(rows: list[dict], path) -> str:
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return os.fspath(path)


if __name__ == "__main__":
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
    write_jsonl(make_rows(40, seed=0), os.path.join(here, "pref_tiny.jsonl"))
    write_jsonl(make_rows(16, seed=1), os.path.join(here, "pref_tiny_eval.jsonl"))

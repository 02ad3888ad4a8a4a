"""A synthetic task with verifiable answers: addition of two numbers, generated from a seed.

Rows are TRL prompt/completion records: {"prompt": "37+85=", "completion": "122"}. The split
into train and held-out pairs is by the unordered pair, so held-out questions are never seen in
training (not even as b+a). Used by `posttrain demo` and the tests; later RL tasks reuse it with
an exact-match reward.
"""

from __future__ import annotations

import json
import os
import random


def make_pairs(digits: int = 2, seed: int = 0, n_eval: int = 200):
    """(train rows, eval rows) covering every a+b with a, b < 10**digits."""
    hi = 10 ** digits
    keys = sorted({(min(a, b), max(a, b)) for a in range(hi) for b in range(hi)})
    rng = random.Random(seed)
    rng.shuffle(keys)
    held = set(keys[:n_eval])
    train, evals = [], []
    for a in range(hi):
        for b in range(hi):
            row = {"prompt": f"{a}+{b}=", "completion": str(a + b)}
            if (min(a, b), max(a, b)) not in held:
                train.append(row)
            elif a <= b:  # one orientation of each held-out pair
                evals.append(row)
    rng.shuffle(train)
    return train, evals


def write_jsonl(rows, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return path

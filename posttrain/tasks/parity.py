"""A synthetic preference task with a hidden rule: the answer naming a number's parity is chosen.

Rows are TRL preference records, {"prompt": "4821?", "chosen": " odd", "rejected": " even"}:
the rule (the parity of the last digit) is never stated, so a model that ranks held-out pairs
right has learned it from the preferences alone. Train and held-out numbers are disjoint. Used by
the DPO and reward-model tests, `configs/dpo_tiny.yaml` and the demo.
"""

from __future__ import annotations

import random


def make_pairs(n_train: int = 256, n_eval: int = 64, seed: int = 0, digits: int = 4):
    """(train rows, held-out rows) over distinct random numbers of `digits` digits."""
    rng = random.Random(seed)
    numbers = rng.sample(range(10 ** (digits - 1), 10 ** digits), n_train + n_eval)
    rows = []
    for n in numbers:
        right, wrong = (" even", " odd") if n % 2 == 0 else (" odd", " even")
        rows.append({"prompt": f"{n}?", "chosen": right, "rejected": wrong})
    return rows[:n_train], rows[n_train:]

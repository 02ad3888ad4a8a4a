"""Unpaired preference rows (KTO): {"prompt", "completion", "label"} -> token ids -> prefix-shared batch rows.

What it is: `tokenize_unpaired(row, where, tok)` (TRL's unpaired rows, strings or lists of messages through
the chat template, or a paired {"prompt", "chosen", "rejected"} row unpaired as TRL does: chosen true,
rejected false), with token ids as TRL 1.16's KTOTrainer: plain strings get the tokenizer's specials and
an eos after the completion; the completion is what follows the common token prefix of the prompt alone
and prompt + completion. `load_unpaired(path, tok, max_length=...)` reads every usable row of a file
(truncation policies, bad rows skipped and counted) and `kto_rows(idx, examples, group=..., ...)` lays a
batch out as prefix-shared rows [prompt_i | completion_i | completion_j], j the row before i in its group
(cyclically): TRL's mismatched (x, y') pairs for the KL estimate.

What it is not: the loss (`losses/kto.py`) or the recipe (`trainers/kto.py`).
"""

from __future__ import annotations

import numpy as np

from posttrain.data.branches import pad_rows, shared_row
from posttrain.data.formats import messages
from posttrain.data.preference import tokenize_pair
from posttrain.data.sources import parse_rows
from posttrain.errors import PosttrainError

ACCEPTED = ('{"prompt", "completion", "label": true/false} (strings, or lists of {"role", "content"} messages), '
            'or paired {"prompt", "chosen", "rejected"} rows')



def tokenize_unpaired(row, where: str, tok) -> list[tuple[list[int], list[int], bool]]:
    """[(prompt ids, completion ids, desirable)] of one row (two for a preference pair); errors name `where`."""
    if isinstance(row, dict) and ("chosen" in row or "rejected" in row):
        p, c, r, _ = tokenize_pair(row, where, tok)
        return [(p, c, True), (p, r, False)]
    if not isinstance(row, dict) or any(k not in row for k in ("prompt", "completion", "label")):
        got = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise PosttrainError(f"{where}: a KTO row needs 'prompt', 'completion' and 'label' (it has {got}); rows "
                             f"must be {ACCEPTED}")
    prompt, completion, label = row["prompt"], row["completion"], row["label"]
    if not isinstance(label, bool):
        raise PosttrainError(f"{where}: 'label' must be true (desirable) or false (undesirable), got {label!r}")
    if not {type(prompt), type(completion)} <= {str} and not {type(prompt), type(completion)} <= {list}:
        raise PosttrainError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of messages, "
                             f"got {type(prompt).__name__} and {type(completion).__name__}")
    if not completion or (isinstance(completion, str) and not completion.strip()):
        raise PosttrainError(f"{where}: the completion is empty; remove the row or fill it in")
    if isinstance(completion, list):
        pm, cm = messages(row, "prompt", where), messages(row, "completion", where)
        p = tok.apply_chat_template(pm, add_generation_prompt=True, where=where)
        full = tok.apply_chat_template(pm + cm, where=where)
    else:
        eos = tok.eos_token or ""  # TRL appends it unless the completion ends with it
        p, full = tok.encode(prompt), tok.encode(prompt + completion + ("" if completion.endswith(eos) else eos))
    n = next((i for i, (x, y) in enumerate(zip(p, full)) if x != y), min(len(p), len(full)))
    if n == 0:
        raise PosttrainError(f"{where}: the prompt is empty after tokenization, and the completion's first token "
                             f"must be scored from a token before it; give a prompt (or a tokenizer that adds BOS)")
    if n == len(full):
        raise PosttrainError(f"{where}: the completion renders to no tokens; check 'completion'")
    return [(list(p[:n]), list(full[n:]), label)]


def load_unpaired(path, tok, *, max_length: int, truncation: str = "error",
                  skip_bad_rows: bool = False) -> tuple[list, dict]:
    """Every usable (prompt, completion, label) of `path` (int32 ids); counts: rows, skipped, truncated, dropped.

    Rows longer than `max_length` tokens (prompt + completion): `truncation` "error" raises naming the row,
    "truncate" cuts the completion's end (TRL), "drop" leaves the row out (a prompt that fills max_length
    is an error under every policy)."""
    counts = {"rows": 0, "skipped": 0, "truncated": 0, "dropped": 0}
    out = []

    def parse(row, where):
        fitted = []
        for p, c, label in tokenize_unpaired(row, where, tok):
            if len(p) + len(c) > max_length:
                room = max_length - len(p)  # a prompt that fills max_length is an error under every policy
                if room < 1 or truncation == "error":
                    raise PosttrainError(f"{where}: prompt ({len(p)} tokens) + completion ({len(c)}) is more than "
                                         f"max_length={max_length}; raise max_length" + (
                                             "" if room < 1 else ", or set truncation to 'truncate' or 'drop'"))
                counts["dropped" if truncation == "drop" else "truncated"] += 1
                if truncation == "drop":
                    continue
                c = c[:room]
            fitted.append((np.asarray(p, np.int32), np.asarray(c, np.int32), label))
        return fitted

    for fitted, _ in parse_rows(path, parse, counts, skip_bad_rows=skip_bad_rows):
        out.extend(fitted)
    if not out:
        raise PosttrainError(f"{path}: no usable KTO rows (rows={counts['rows']}, skipped={counts['skipped']}, "
                             f"dropped={counts['dropped']}); rows must be {ACCEPTED}")
    return out, counts


def kto_rows(idx, examples: list, *, group: int, length: int, score_length: int, pad_id: int, kl: bool) -> dict:
    """Rows `idx` as one batch: [prompt_i | completion_i (| completion_j, j the previous row in its group of
    `group`, cyclically: TRL's rotation)] and "label" [B] (1 desirable)."""
    idx = np.asarray(idx)
    rows = []
    for j, i in enumerate(idx):
        p, c, _ = examples[i]
        start = j - j % group
        n = min(group, len(idx) - start)
        rows.append(shared_row(p, [c, examples[idx[start + (j - start - 1) % n]][1]] if kl else [c]))
    out = pad_rows(rows, length, score_length, pad_id)
    out["label"] = np.asarray([examples[i][2] for i in idx], np.int32)
    return out

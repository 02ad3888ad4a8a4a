"""Prefix-shared rows: a prompt once, then its k continuations as branches of the same row.

What it is: the row layout that DPO pairs (k = 2) and GRPO groups (k = n) train on (Prefix
Grouper, arXiv 2506.05433). A row is [prompt | c_1 | ... | c_k] with
  tokens       int32  ids; pad_id after the last branch
  positions    int32  0 .. P-1 on the prompt; each branch again P, P+1, ... (as if alone after it)
  segment_ids  int32  1 on real tokens, 0 on padding
  branch_ids   int32  0 on the prompt (and padding), i on continuation i
and, for scoring, M = sum of continuation lengths entries (padded to a fixed length):
  score_src    int32  the slot whose hidden state predicts the token: the prompt's last slot for
                      a branch's first token, else the branch's previous slot
  score_tgt    int32  the continuation token
  score_branch int32  its branch (1..k); 0 on padding
  score_w      float32 1 on real entries (or the caller's per-token weights), 0 on padding
The attention rule (models/attention.py) lets each branch see the prompt and itself only, so
every branch token's log-probability equals the one in the unshared row [prompt | c_i]
(tests/test_branches.py), while the prompt is computed once instead of k times.

`group_row` lays the score entries out in fixed-width per-branch slots instead (RL groups).

What it is not: a file format (the preference / RL trainers read their rows and call this),
and not packing of several groups into one row.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from posttrain.errors import PosttrainError

ROW_FIELDS = ("tokens", "positions", "segment_ids", "branch_ids")
SCORE_FIELDS = ("score_src", "score_tgt", "score_branch", "score_w")


def shared_row(prompt: Sequence[int], continuations: Sequence[Sequence[int]],
               weights: Optional[Sequence[Sequence[float]]] = None) -> dict:
    """One prefix-shared row (unpadded numpy arrays, see the module docstring)."""
    P = len(prompt)
    if P == 0:
        raise PosttrainError("prefix-shared row: the prompt is empty; a branch's first token needs a prompt "
                             "token to be scored from (add BOS)")
    if not continuations or any(len(c) == 0 for c in continuations):
        raise PosttrainError("prefix-shared row: every continuation needs at least one token")
    toks, pos, br = [list(prompt)], [np.arange(P)], [np.zeros(P, np.int64)]
    src, tgt, sbr, w = [], [], [], []
    slot = P
    for i, c in enumerate(continuations):
        n = len(c)
        toks.append(list(c))
        pos.append(P + np.arange(n))
        br.append(np.full(n, i + 1))
        src.append(np.concatenate([[P - 1], slot + np.arange(n - 1)]))
        tgt.append(np.asarray(c))
        sbr.append(np.full(n, i + 1))
        w.append(np.ones(n) if weights is None else np.asarray(weights[i], np.float64))
        slot += n
    cat = np.concatenate
    return dict(tokens=cat(toks).astype(np.int32), positions=cat(pos).astype(np.int32),
                segment_ids=np.ones(slot, np.int32), branch_ids=cat(br).astype(np.int32),
                score_src=cat(src).astype(np.int32), score_tgt=cat(tgt).astype(np.int32),
                score_branch=cat(sbr).astype(np.int32), score_w=cat(w).astype(np.float32))


def pad_rows(rows: Sequence[dict], length: int, score_length: int, pad_id: int = 0) -> dict:
    """Stack rows into a batch: row fields [B, length], score fields [B, score_length]."""
    B = len(rows)
    out = {f: np.zeros((B, length), np.int32) for f in ROW_FIELDS}
    out.update({f: np.zeros((B, score_length), np.float32 if f == "score_w" else np.int32) for f in SCORE_FIELDS})
    out["tokens"][:] = pad_id
    for b, r in enumerate(rows):
        n, m = len(r["tokens"]), len(r["score_tgt"])
        if n > length or m > score_length:
            raise PosttrainError(f"prefix-shared row {b}: {n} tokens / {m} scored tokens exceed the batch's "
                                 f"{length} / {score_length}; raise max_length")
        for f in ROW_FIELDS:
            out[f][b, :n] = r[f]
        for f in SCORE_FIELDS:
            out[f][b, :m] = r[f]
    return out


def group_row(prompt: Sequence[int], continuations: Sequence[Sequence[int]], width: int) -> dict:
    """A prefix-shared row whose score entries sit in fixed-width slots: continuation j's token t
    is entry j * width + t (t < len_j; entries past a continuation's end are padding, weight 0),
    so per-token arrays reshape to [k, width] (GRPO: the sampler's [n, max_new] layout)."""
    row = shared_row(prompt, continuations)
    k = len(continuations)
    if any(len(c) > width for c in continuations):
        raise PosttrainError(f"group row: a continuation is longer than the slot width {width}")
    idx = np.concatenate([j * width + np.arange(len(c)) for j, c in enumerate(continuations)])
    for f in SCORE_FIELDS:
        out = np.zeros(k * width, row[f].dtype)
        out[idx] = row[f]
        row[f] = out
    return row


def unshared_rows(prompt: Sequence[int], continuations: Sequence[Sequence[int]]) -> list[dict]:
    """The reference layout: k rows [prompt | c_i], each a one-branch shared row (for tests and benchmarks)."""
    return [shared_row(prompt, [c]) for c in continuations]

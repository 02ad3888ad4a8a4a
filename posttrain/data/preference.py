"""Preference rows: (prompt, chosen, rejected) -> token ids -> prefix-shared pair rows -> Grain batches.

What it is: the data side of the DPO and reward-model trainers.
  - `tokenize_pair(row, where, tok)` accepts TRL's preference formats unchanged
    (https://huggingface.co/docs/trl/dataset_formats#preference):
      {"prompt": str, "chosen": str, "rejected": str}              standard, explicit prompt
      {"chosen": str, "rejected": str}                             standard, implicit prompt
      {"prompt": [messages], "chosen": [messages], "rejected": [messages]}   conversational
      {"chosen": [messages], "rejected": [messages]}               conversational, implicit prompt
    An implicit prompt is the longest common start of chosen and rejected (characters for
    strings, whole messages for conversations), as TRL's `extract_prompt` does. Token ids follow
    TRL 1.16's DPOTrainer: plain strings get the tokenizer's BOS and an eos after each answer;
    conversations go through the chat template (no eos added: the template ends the turn).
    An optional numeric "margin" column is kept (reward models' margin loss).
  - Rows with images (TRL's vision preference rows: a conversational `prompt` with {"type": "image"}
    parts, or plain-text turns that then get the images before the first user text, as TRL's
    `prepare_multimodal_messages`; `images` as paths relative to the data file, bytes or
    `datasets.Image`, or one `image`) need `images=` (a `data.images.ImageSpec`, from a Qwen3-VL
    folder): `tokenize_image_pair` renders them as TRL's DataCollatorForVisionPreference does, the
    prompt's image tokens expanded as Qwen3VLProcessor does; the Pair keeps the pixels and grids,
    and its row gets [3, L] M-RoPE positions and the patch tables (`data.images.shared_image_fields`).
    An image prompt is never cut (answers are). A bad or missing image is a row error.
  - `load_pairs(path, tok, max_length=...)` reads and tokenizes every row once. `max_length`
    bounds prompt + the longer answer (TRL's meaning). Truncation: "error" (default) raises
    naming the row; "truncate" keeps the prompt's last `max_prompt_length` tokens and cuts
    answers at the end to fit; "drop" drops rows that do not fit (counted). A prompt that leaves
    no room for an answer is a row error under every policy.
  - `pair_shapes`, `pair_arrays`, `pair_batches`: each pair as one prefix-shared row
    [prompt | chosen | rejected] (branch 1 = chosen, 2 = rejected; `data/branches.py`), padded to
    one static shape for the whole run, and a Grain pipeline whose iterator resumes exactly.

Row errors (missing column, wrong type, empty answer, identical chosen and rejected, no room
for an answer) raise PosttrainError naming FILE:LINE, or are skipped and counted when
`skip_bad_rows` is set.

What it is not: the loss (`losses/dpo.py`, `losses/preference.py`) or the trainer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import grain
import numpy as np

from posttrain.data.branches import pad_rows, shared_row
from posttrain.data.formats import messages
from posttrain.data.images import expand_images, image_messages, row_images, shared_image_fields
from posttrain.data.sources import parse_rows
from posttrain.errors import PosttrainError

PAIR_TRUNCATION = ("error", "truncate", "drop")
ACCEPTED = ('{"prompt", "chosen", "rejected"} (strings, or lists of {"role", "content"} messages), or '
            '{"chosen", "rejected"} with the prompt as their common start')


@dataclass
class Pair:
    prompt: np.ndarray  # int32 [P]
    chosen: np.ndarray  # int32 [C]
    rejected: np.ndarray  # int32 [R]
    where: str  # "FILE:LINE" for messages
    margin: float = 0.0  # the row's "margin" column (reward models), 0 when absent
    pixels: Optional[np.ndarray] = None  # float32 [patches, dim]: the prompt's image patches (image rows)
    grids: Optional[np.ndarray] = None  # int64 [images, 3]: their (t, h, w) grids


def _kind(v) -> str:
    return "null" if v is None else f"a {type(v).__name__}"


def _common_start(a, b) -> int:
    """TRL's `extract_prompt` split point, quirks included (so the same rows give the same prompts):
    the first difference, moved back before a space that precedes it; without a difference, the
    last index of the shorter one."""
    idx = 0
    for idx in range(min(len(a), len(b))):
        if a[idx] != b[idx]:
            if a[idx - 1] == " ":
                idx -= 1
            break
    return idx


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tokenize_pair(row, where: str, tok) -> tuple[list[int], list[int], list[int], float]:
    """(prompt ids, chosen ids, rejected ids, margin) of one preference row; errors name `where`.

    Tokenized as TRL 1.16's DPOTrainer does: the prompt alone and prompt + answer are each
    tokenized whole (plain strings with the tokenizer's specials and the eos text appended to the
    answer; conversations through the chat template), and the answer is what follows their common
    token prefix (a template may render the prompt alone slightly differently)."""
    if not isinstance(row, dict):
        raise PosttrainError(f"{where}: a row must be an object, got {_kind(row)}; rows must be {ACCEPTED}")
    for col in ("chosen", "rejected"):
        if col not in row:
            raise PosttrainError(f"{where}: the row has no '{col}' column (it has {sorted(row)}); rows must be "
                                 f"{ACCEPTED}")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    margin = row.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not np.isfinite(margin):
        raise PosttrainError(f"{where}: 'margin' must be a finite number, got {margin!r}")
    conversational = isinstance(chosen, list)
    for col, v in (("chosen", chosen), ("rejected", rejected)) + ((("prompt", prompt),) if "prompt" in row else ()):
        if not isinstance(v, (list, str)) or isinstance(v, list) != conversational:
            raise PosttrainError(f"{where}: '{col}' is {_kind(v)} but 'chosen' is {_kind(chosen)}; the columns "
                                 f"must all be strings or all lists of messages")
    if chosen == rejected:
        raise PosttrainError(f"{where}: 'chosen' and 'rejected' are identical, so the pair prefers nothing; "
                             f"remove the row or fix one of them")
    if prompt is None:  # implicit prompt: the common start
        cut = _common_start(chosen, rejected)
        prompt, chosen, rejected = chosen[:cut], chosen[cut:], rejected[cut:]
    for col, v in (("chosen", chosen), ("rejected", rejected)):
        if not v or (isinstance(v, str) and not v.strip()):
            raise PosttrainError(f"{where}: the '{col}' answer is empty; remove the row or fill it in (there is "
                                 f"nothing to compare)")
    if not conversational:
        eos = tok.eos_token or ""
        p = tok.encode(prompt)
        full = [tok.encode(prompt + (a if a.endswith(eos) else a + eos)) for a in (chosen, rejected)]
    else:
        msgs = [messages({k: v}, k, where) if v else [] for k, v in
                (("prompt", prompt), ("chosen", chosen), ("rejected", rejected))]
        if not msgs[0]:
            raise PosttrainError(f"{where}: the prompt is empty; give the conversation's first turns as 'prompt'")
        p = tok.apply_chat_template(msgs[0], add_generation_prompt=True, where=where)
        full = [tok.apply_chat_template(msgs[0] + a, where=where) for a in msgs[1:]]
    n = min(_common_prefix(p, f) for f in full)
    p, c, r = list(p[:n]), list(full[0][n:]), list(full[1][n:])
    if not p:
        raise PosttrainError(f"{where}: the prompt is empty after tokenization, and an answer's first token must be "
                             f"scored from a token before it; give a prompt (or use a tokenizer that adds BOS)")
    if not c or not r:
        raise PosttrainError(f"{where}: an answer renders to no tokens; check 'chosen' and 'rejected'")
    return p, c, r, float(margin)


def tokenize_image_pair(row: dict, where: str, tok, spec, base: Path):
    """(prompt ids, chosen ids, rejected ids, margin, pixels, grids) of a preference row with images: its
    conversations as TRL 1.16's DataCollatorForVisionPreference renders them (`prepare_multimodal_messages`: the
    prompt's image parts, or the images before the first user text; the answers' text as parts), tokenized as
    `tokenize_pair`, then the prompt's image tokens expanded and the images patched (`data.images`)."""
    images = row_images(row, where, spec)
    chosen, rejected, prompt = row.get("chosen"), row.get("rejected"), row.get("prompt")
    if prompt is None and isinstance(chosen, list) and isinstance(rejected, list):  # implicit prompt: common turns
        cut = _common_start(chosen, rejected)
        prompt, chosen, rejected = chosen[:cut], chosen[cut:], rejected[cut:]
    if not isinstance(prompt, list) or not prompt:
        raise PosttrainError(f"{where}: a preference row with images needs a conversational prompt (a list of "
                             f'messages with {{"type": "image"}} parts where the images go), got '
                             f"{_kind(prompt)}; rows must be {ACCEPTED}")
    out = {k: v for k, v in row.items() if k not in ("images", "image")}
    out["prompt"] = image_messages(prompt, images, where)
    for col, v in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(v, list):
            v = image_messages(v, [], where, col) if v else v
        out[col] = v
    p, c, r, margin = tokenize_pair(out, where, tok)
    image_id = spec.vision.image_token_id
    if image_id in c or image_id in r:
        raise PosttrainError(f"{where}: an answer holds the image token (id {image_id}); images go in the prompt "
                             "only")
    p, pixels, grids = expand_images(p, images, where, spec, base, tok)
    return p, c, r, margin, pixels, grids


def load_pairs(path, tok, *, max_length: int, max_prompt_length: Optional[int] = None, truncation: str = "error",
               skip_bad_rows: bool = False, images=None) -> tuple[list[Pair], dict]:
    """Every usable pair of `path`; counts = {"rows", "skipped", "truncated", "dropped"}. `images` (a
    `data.images.ImageSpec`) reads rows with images; without it such a row is an error."""
    if truncation not in PAIR_TRUNCATION:
        raise PosttrainError(f"truncation={truncation!r}: use one of {', '.join(PAIR_TRUNCATION)}")
    counts = {"rows": 0, "skipped": 0, "truncated": 0, "dropped": 0}
    base = Path(path) if Path(path).is_dir() else Path(path).parent  # image paths are relative to the data file

    def parse(row, where):
        if row_images(row, where, images) is None:
            p, c, r, margin = tokenize_pair(row, where, tok)
            return _fit(p, c, r, where, max_length, max_prompt_length, truncation) + (margin, None, None)
        p, c, r, margin, pixels, grids = tokenize_image_pair(row, where, tok, images, base)
        if truncation == "truncate" and max_prompt_length and len(p) > max_prompt_length:
            raise PosttrainError(f"{where}: the prompt with its image tokens is {len(p)} tokens, more than "
                                 f"max_prompt_length={max_prompt_length}, and an image prompt is never cut; raise "
                                 "data.max_prompt_length (or unset it), or set data.truncation=drop")
        return _fit(p, c, r, where, max_length, None, truncation) + (margin, pixels, grids)

    pairs = []
    for (p, c, r, status, margin, pixels, grids), where in parse_rows(path, parse, counts,
                                                                      skip_bad_rows=skip_bad_rows):
        if status:
            counts[status] += 1
            if status == "dropped":
                continue
        pairs.append(Pair(*(np.asarray(x, np.int32) for x in (p, c, r)), where=where, margin=margin, pixels=pixels,
                          grids=grids))
    if not pairs:
        raise PosttrainError(f"{path}: no usable preference pairs (rows={counts['rows']}, skipped="
                             f"{counts['skipped']}, dropped={counts['dropped']}); rows must be {ACCEPTED}")
    return pairs, counts


def load_pair_sets(data, tok, images=None) -> tuple[list[Pair], dict, Optional[list[Pair]]]:
    """(train pairs, their counts, eval pairs or None) of a PreferenceDataSection (data.train / data.eval);
    `images`: see `load_pairs`."""
    kw = dict(max_length=data.max_length, max_prompt_length=data.max_prompt_length, truncation=data.truncation,
              skip_bad_rows=data.skip_bad_rows, images=images)
    train, stats = load_pairs(data.train, tok, **kw)
    return train, stats, load_pairs(data.eval, tok, **kw)[0] if data.eval else None


def _fit(p, c, r, where, max_length, max_prompt_length, truncation):
    """Apply the truncation policy; (prompt, chosen, rejected, "" | "truncated" | "dropped")."""
    longest = max(len(c), len(r))
    if len(p) + longest <= max_length:
        return p, c, r, ""
    if truncation == "drop":
        return p, c, r, "dropped"
    status = "truncated"
    if truncation == "truncate" and max_prompt_length and len(p) > max_prompt_length:
        p = p[len(p) - max_prompt_length:]
    if len(p) >= max_length:
        fix = ("set data.max_prompt_length below max_length" if truncation == "truncate"
               else "raise data.max_length, or set data.truncation=truncate with data.max_prompt_length")
        raise PosttrainError(f"{where}: the prompt is {len(p)} tokens, which leaves no room for an answer under "
                             f"max_length={max_length}; {fix}")
    if truncation == "error":
        raise PosttrainError(f"{where}: prompt ({len(p)} tokens) + the longer answer ({longest}) is more than "
                             f"max_length={max_length}; raise data.max_length, or set data.truncation to "
                             f"'truncate' or 'drop'")
    room = max_length - len(p)
    return p, c[:room], r[:room], status


def pair_shapes(*groups: list[Pair], multiple: int = 8) -> tuple[int, int]:
    """(row length, scored length) that fits every pair of the groups, rounded up to `multiple`."""
    pairs = [p for g in groups for p in g]
    up = lambda n: -(-n // multiple) * multiple  # noqa: E731
    return (up(max(len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs)),
            up(max(len(p.chosen) + len(p.rejected) for p in pairs)))


def _pair_row(i: int, pairs: list[Pair], length: int, score_length: int, pad_id: int, extra: dict, vision=None,
              patches: int = 0) -> dict:
    p = pairs[i]
    row = pad_rows([shared_row(p.prompt, [p.chosen, p.rejected])], length, score_length, pad_id)
    out = {k: v[0] for k, v in row.items()}
    if vision is not None:  # an image dataset: every row (text pairs too) carries the image fields
        out.update(shared_image_fields(p.prompt, p.pixels, p.grids, out, vision, patches))
    out["margin"] = np.float32(p.margin)
    out.update({k: v[i] for k, v in extra.items()})
    return out


def pair_arrays(pairs: list[Pair], length: int, score_length: int, pad_id: int, extra: Optional[dict] = None,
                vision=None, patches: int = 0) -> dict:
    """Every pair as one padded prefix-shared row: dict of [N, ...] arrays (eval, precomputing). With `vision`
    (the model's VisionConfig: image pairs) also the image fields, patches padded to `patches`."""
    rows = [_pair_row(i, pairs, length, score_length, pad_id, extra or {}, vision, patches)
            for i in range(len(pairs))]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def pair_batches(pairs: list[Pair], *, batch_size: int, length: int, score_length: int, pad_id: int, seed: int,
                 shuffle: bool = True, extra: Optional[dict] = None, vision=None,
                 patches: int = 0) -> grain.IterDataset:
    """Grain batches of pair rows, reshuffled each epoch, forever; `extra` adds per-pair arrays
    ([N, ...], e.g. precomputed reference log-probs) to each row; `vision`, `patches`: see `pair_arrays`.
    The iterator resumes exactly."""
    if len(pairs) < batch_size:
        raise PosttrainError(f"{len(pairs)} preference pairs are fewer than train.batch_size={batch_size}; lower "
                             f"the batch size or add data")
    ds = grain.MapDataset.range(len(pairs))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(None).map(functools.partial(_pair_row, pairs=pairs, length=length, score_length=score_length,
                                               pad_id=pad_id, extra=extra or {}, vision=vision,
                                               patches=patches))
    opts = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4 * batch_size)
    return ds.to_iter_dataset(opts).batch(batch_size, drop_remainder=True)

"""Prompt rows for RL: {"prompt": str | [messages], <other columns>} -> token ids + the row's columns.

What it is: `load_prompts(path, tok, max_prompt_length=...)` reads TRL's prompt-only format
(https://huggingface.co/docs/trl/dataset_formats#prompt-only): "prompt" is a string (tokenized
with the tokenizer's specials, e.g. BOS) or a list of messages (rendered by the chat template
with the generation prompt). Every other column (e.g. "answer") is kept and handed to the reward
functions, as TRL does. A missing or empty prompt, or one longer than `max_prompt_length` tokens
(the sampler's budget), raises naming FILE:LINE, or is skipped and counted with `skip_bad_rows`.
With `images` (a `data.images.ImageSpec`, from a Qwen3-VL folder) a row with an `images` (or `image`) column is
TRL's vision prompt (`data.images.encode_image_prompt`: image tokens expanded; the pixels and grids kept on the
Prompt for the sampler and the update); a bad image is a row error as in SFT. The columns, `images` included, still
go to the reward functions, as TRL passes them.

What it is not: the rollout (`posttrain/rl/rollout.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from posttrain.data.formats import messages
from posttrain.data.images import encode_image_prompt, row_images
from posttrain.data.sources import parse_rows
from posttrain.errors import PosttrainError


@dataclass
class Prompt:
    ids: np.ndarray  # int32 [P]
    prompt: object  # the row's "prompt" as given (str or messages), for reward functions
    columns: dict = field(default_factory=dict)  # the row's other columns
    where: str = ""
    pixels: Optional[np.ndarray] = None  # float32 [patches, dim]: an image prompt's patches (data/images.py)
    grids: Optional[np.ndarray] = None  # int64 [images, 3]: their (t, h, w) grids


def tokenize_prompt(row, where: str, tok, max_prompt_length: int, images=None, base=None) -> Prompt:
    if not isinstance(row, dict) or "prompt" not in row:
        have = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise PosttrainError(f"{where}: the row has no 'prompt' column (it has {have}); RL rows are "
                             f'{{"prompt": str or [messages], ...other columns for the reward functions}}')
    prompt, pixels, grids = row["prompt"], None, None
    if row_images(row, where, images) is not None:
        ids, pixels, grids = encode_image_prompt(row, where, tok, images, base)
    elif isinstance(prompt, str):
        if not prompt.strip():
            raise PosttrainError(f"{where}: 'prompt' is empty; remove the row or fill it in")
        ids = tok.encode(prompt)
    elif isinstance(prompt, list):
        ids = tok.apply_chat_template(messages(row, "prompt", where), add_generation_prompt=True, where=where)
    else:
        raise PosttrainError(f"{where}: 'prompt' must be a string or a list of messages, got "
                             f"{type(prompt).__name__}")
    if len(ids) > max_prompt_length:
        raise PosttrainError(f"{where}: the prompt is {len(ids)} tokens, more than data.max_prompt_length="
                             f"{max_prompt_length} (the sampler's prompt budget); raise it or shorten the prompt")
    reserved = sorted({"prompts", "completions", "completion_ids"} & set(row))
    if reserved:
        raise PosttrainError(f"{where}: column {reserved[0]!r} is reserved (reward functions receive prompts, "
                             f"completions and completion_ids themselves); rename it")
    return Prompt(np.asarray(ids, np.int32), prompt, {k: v for k, v in row.items() if k != "prompt"}, where,
                  pixels, grids)


def load_prompts(path, tok, *, max_prompt_length: int, skip_bad_rows: bool = False,
                 images=None) -> tuple[list[Prompt], dict]:
    """Every usable prompt of `path`; counts = {"rows", "skipped"}; `images`: see the module docstring."""
    counts = {"rows": 0, "skipped": 0}
    base = Path(path) if Path(path).is_dir() else Path(path).parent
    parse = lambda row, where: tokenize_prompt(row, where, tok, max_prompt_length, images, base)  # noqa: E731
    out = [p for p, _ in parse_rows(path, parse, counts, skip_bad_rows=skip_bad_rows)]
    if not out:
        raise PosttrainError(f"{path}: no usable prompts (rows={counts['rows']}, skipped={counts['skipped']})")
    return out, counts


def _content(value):
    """The text of a completion given as a string or as messages (the last message's content)."""
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        return value[-1].get("content")
    return value


def as_prompt_row(row, where: str):
    """An evaluation row as a prompt row with an 'answer' column: prompt rows as they are; a
    prompt/completion or preference row's completion / chosen answer becomes 'answer' (unless the row
    has one); a conversation's last assistant turn becomes 'answer' and the turns before it the prompt."""
    if not isinstance(row, dict):
        return row
    if "prompt" not in row and isinstance(row.get("messages"), list):
        turns = row["messages"]
        last = max((i for i, m in enumerate(turns) if isinstance(m, dict) and m.get("role") == "assistant"),
                   default=None)
        if last is None:
            raise PosttrainError(f"{where}: the conversation has no assistant turn to use as the reference answer")
        row = {**{k: v for k, v in row.items() if k != "messages"}, "prompt": turns[:last],
               "answer": row.get("answer", turns[last].get("content"))}
    elif "answer" not in row:
        for name in ("completion", "chosen"):
            if name in row:
                row = {**row, "answer": _content(row[name])}
                break
    return row


def eval_prompts(path, tok, *, max_prompt_length: int, limit: Optional[int] = None) -> list[Prompt]:
    """The prompts of an evaluation file (`as_prompt_row`: the prompt rows of RL, or the SFT / preference
    rows of a held-out set, their reference answer in 'answer'); the first `limit` rows when given."""
    counts = {"rows": 0, "skipped": 0}
    parse = lambda row, where: tokenize_prompt(as_prompt_row(row, where), where, tok, max_prompt_length)  # noqa: E731
    out = [p for p, _ in parse_rows(path, parse, counts)]
    if not out:
        raise PosttrainError(f"{path}: no evaluation prompts (rows={counts['rows']})")
    return out[:limit] if limit else out

"""Data pipeline: rows -> tokenized examples -> fixed-shape (optionally packed) rows -> Grain batches.

What it is:
  - `load_examples(path, tok, max_length=...)` reads and tokenizes every row once, applies the
    truncation policy, and returns `Example`s plus counts of what happened to the rows.
  - `to_arrays(examples, seq_len, pad_id, packing)` lays examples out as [R, seq_len] rows.
  - `batches(examples, ...)` is a Grain pipeline over those rows whose iterator is checkpointable
    (`get_state` / `set_state` resume bit-exactly, across epochs too).

Field conventions of a row (all [seq_len]; a batch adds a leading [batch_size]):
  tokens       int32  ids, pad_id after the last sequence
  positions    int32  0, 1, ... restarting at each packed sequence; 0 on padding
  segment_ids  int32  1, 2, ... one per packed sequence; 0 on padding (attend only within a segment)
  targets      int32  tokens[t+1] when t+1 is in the same segment, else 0
  weights      float32 loss_mask[t+1] when t+1 is in the same segment, else 0
so the loss is sum(weights * CE(logits[t], targets[t])) / sum(weights), and no target ever needs
attention across a sequence boundary.

Packing is first-fit in example order (each example goes into the first row with room), done
once; `batches` then shuffles whole rows, differently each epoch. Packing once keeps every row
a pure function of its index, which is what makes Grain's index-based checkpoint exact and
cheap; the price is that the same examples always share a row (harmless: segments never see
each other). Image rows pack too: a row carries its examples' images in order, each segment's M-RoPE
positions restart (`data.images.group_image_fields`), and the patch bucket is the most patches of a row.

What it is not: no streaming of datasets larger than host memory (examples are held as small
int32 arrays), no multi-host sharding (slice the returned dataset per process), no tokenization
rules (`formats.py`) and no file formats (`sources.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from posttrain.data.formats import tokenize_row
from posttrain.data.images import encode_image_row, group_image_fields, group_patch_bucket, has_images
from posttrain.data.sources import parse_rows
from posttrain.errors import PosttrainError

TRUNCATION = ("error", "keep_start", "keep_end", "drop")
FIELDS = ("tokens", "positions", "segment_ids", "targets", "weights")


@dataclass
class Example:
    """One tokenized sequence; `where` ("FILE:LINE" or "FILE:row N") is kept for error messages."""

    ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # int32 [n], 1 where token i is a training target
    where: str
    pixels: np.ndarray | None = None  # float32 [patches, dim]: an image row's patches (data/images.py)
    grids: np.ndarray | None = None  # int64 [images, 3]: their (t, h, w) grids


def load_examples(
    path, tok, *, max_length: int, truncation: str = "error", skip_bad_rows: bool = False, images=None,
    **format_kw
) -> tuple[list[Example], dict]:
    """Read + tokenize every row of `path`; counts = {"rows", "skipped", "truncated", "dropped"}.

    `format_kw` goes to `formats.tokenize_row` (completion_only_loss, assistant_only_loss, add_eos).
    "dropped" counts rows removed by truncation="drop", and rows a keep_* truncation left with no
    trained target (they would only cost compute).
    `images` (a `data.images.ImageSpec`, from the model folder) encodes rows with an `images` column; without
    it such a row is an error. An image row longer than max_length is an error or dropped (cutting it would cut
    its image tokens).
    """
    if truncation not in TRUNCATION:
        raise PosttrainError(f"truncation={truncation!r} is not a policy; use one of {', '.join(TRUNCATION)}")
    if not isinstance(max_length, int) or max_length < 2:
        raise PosttrainError(
            f"max_length={max_length!r} must be an int >= 2 (a target needs a token before it)"
        )
    counts = {"rows": 0, "skipped": 0, "truncated": 0, "dropped": 0}
    examples = []
    base = Path(path) if Path(path).is_dir() else Path(path).parent

    def parse(row, where):
        if not has_images(row):
            return (*tokenize_row(row, where, tok, **format_kw), None, None)
        if images is None:
            raise PosttrainError(f"{where}: the row has images but the model is not a vision-language model (or "
                                 "this trainer reads text only); drop the 'images' column or use a qwen3_vl folder")
        return encode_image_row(row, where, tok, images, base, **format_kw)

    for (ids, mask, pixels, grids), where in parse_rows(path, parse, counts, skip_bad_rows=skip_bad_rows):
        if len(ids) > max_length:
            if truncation == "error" or (pixels is not None and truncation != "drop"):
                raise PosttrainError(
                    f"{where}: the row is {len(ids)} tokens long, more than max_length={max_length}; raise "
                    f"max_length, or set truncation to " + ("'drop' (an image row is never cut)" if pixels is not
                                                            None else "'keep_start', 'keep_end' or 'drop'")
                    + f" (policies: {', '.join(TRUNCATION)})"
                )
            if truncation == "drop":
                counts["dropped"] += 1
                continue
            cut = (
                slice(None, max_length) if truncation == "keep_start" else slice(len(ids) - max_length, None)
            )
            ids, mask = ids[cut], mask[cut]
            if not any(mask[1:]):  # token 0 is never a target: nothing left to learn from
                counts["dropped"] += 1
                continue
            counts["truncated"] += 1
        examples.append(Example(np.asarray(ids, np.int32), np.asarray(mask, np.int32), where, pixels, grids))
    if not examples:
        raise PosttrainError(
            f"{path}: no usable examples (rows={counts['rows']}, skipped={counts['skipped']}, "
            f"dropped={counts['dropped']}); check the file has rows in an accepted format and that "
            f"max_length={max_length} / truncation={truncation!r} keep some of them"
        )
    return examples, counts


def pack_first_fit(lengths, seq_len: int) -> list[list[int]]:
    """Indices of the examples in each row: example i goes into the first row with room for it."""
    room = np.full(len(lengths), seq_len, np.int64)  # never more rows than examples
    rows: list[list[int]] = []
    for i, n in enumerate(lengths):
        # The first open row with room; if none, argmax lands on the next fresh row (room == seq_len).
        r = int(np.argmax(room[: len(rows) + 1] >= n))
        if r == len(rows):
            rows.append([])
        rows[r].append(i)
        room[r] -= n
    return rows


def _row_groups(examples: list[Example], seq_len: int, packing: bool) -> list[tuple[int, ...]]:
    if not isinstance(seq_len, int) or seq_len < 2:
        raise PosttrainError(f"seq_len={seq_len!r} must be an int >= 2")
    if not examples:
        raise PosttrainError("there are no examples to lay out; load_examples found none")
    for ex in examples:
        if len(ex.ids) > seq_len:
            raise PosttrainError(
                f"{ex.where}: the example is {len(ex.ids)} tokens long, more than seq_len={seq_len}; "
                f"load the data with max_length <= seq_len so truncation applies"
            )
    if not packing:
        return [(i,) for i in range(len(examples))]
    return [tuple(g) for g in pack_first_fit([len(ex.ids) for ex in examples], seq_len)]


def _build_row(group, examples: list[Example], seq_len: int, pad_id: int, vision=None,
               patches: int = 0) -> dict[str, np.ndarray]:
    row = {
        "tokens": np.full(seq_len, pad_id, np.int32),
        "positions": np.zeros(seq_len, np.int32),
        "segment_ids": np.zeros(seq_len, np.int32),
        "targets": np.zeros(seq_len, np.int32),
        "weights": np.zeros(seq_len, np.float32),
    }
    start = 0
    for segment, i in enumerate(group, start=1):
        ids, mask = examples[i].ids, examples[i].loss_mask
        end = start + len(ids)
        row["tokens"][start:end] = ids
        row["positions"][start:end] = np.arange(len(ids))
        row["segment_ids"][start:end] = segment
        # Position t predicts token t+1 of its own sequence; the last token of a sequence predicts
        # nothing (target 0, weight 0), so no loss term ever depends on another segment.
        row["targets"][start : end - 1] = ids[1:]
        row["weights"][start : end - 1] = mask[1:]
        start = end
    if vision is not None:  # an image dataset: every row (text ones too) carries the image fields
        row.update(group_image_fields([examples[i] for i in group], row, vision, patches))
    return row


def to_arrays(examples: list[Example], seq_len: int, pad_id: int, packing: bool,
              vision=None) -> dict[str, np.ndarray]:
    """All examples as fixed-shape [R, seq_len] rows (one per example, or first-fit packed); with image rows
    (`vision`: the model's VisionConfig) also the fields of `vision.batched`."""
    groups = _row_groups(examples, seq_len, packing)
    layout = _image_layout(examples, groups, vision)
    rows = [_build_row(g, examples, seq_len, pad_id, **layout) for g in groups]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _image_layout(examples: list[Example], groups, vision) -> dict:
    """_build_row's image arguments: none for text data, else the vision config and the patch bucket (the most
    patches of any row's group of examples: packed rows hold several examples' images)."""
    if not any(ex.pixels is not None for ex in examples):
        return {}
    if vision is None:
        raise PosttrainError("the examples have images but no vision config was given; pass the model's "
                             "cfg.vision (a vision-language model)")
    return dict(vision=vision, patches=group_patch_bucket(examples, groups, vision))


class _Quiet(list):
    """The examples as a list whose repr is short: Grain prints its map function when it builds the
    first batch (measured: ~2 s for 9,605 examples, on every SFT / distillation run)."""

    def __repr__(self) -> str:
        return f"<{len(self)} examples>"


def batches(
    examples: list[Example],
    *,
    batch_size: int,
    seq_len: int,
    pad_id: int,
    packing: bool,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    read_options: grain.ReadOptions | None = None,
    vision=None,
) -> grain.IterDataset:
    """A Grain dataset of dicts of [batch_size, seq_len] arrays (fields of `to_arrays`).

    Rows are reshuffled each epoch (Grain folds the epoch into the shuffle seed under `repeat`);
    batches run across epoch boundaries and only a final partial batch is dropped. num_epochs=None
    repeats forever. `iter(ds).get_state()` / `.set_state(state)` resume exactly.
    `read_options` defaults to 2 threads prefetching 4 batches: building a row is cheap numpy
    under the GIL, and Grain's default (16 threads, 500 rows) only burns host CPU that the
    training step wants (and re-does it after every set_state).
    Image rows (`vision`: the model's VisionConfig) add the fields of `vision.batched` ([B, 3, T] positions).
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise PosttrainError(f"batch_size={batch_size!r} must be a positive int")
    if not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise PosttrainError(f"seed={seed!r} must be an int in [0, 2**32)")
    if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 1):
        raise PosttrainError(f"num_epochs={num_epochs!r} must be a positive int, or None to repeat forever")
    groups = _row_groups(examples, seq_len, packing)
    if num_epochs is not None and len(groups) * num_epochs < batch_size:
        raise PosttrainError(
            f"{len(groups)} rows x {num_epochs} epochs is fewer than batch_size={batch_size}, so no full "
            f"batch can be made; lower batch_size, add data, or raise num_epochs"
        )
    ds = grain.MapDataset.source(groups)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    # repeat after shuffle: each epoch's indices reach the shuffle with the epoch folded into its seed.
    ds = ds.repeat(num_epochs)
    ds = ds.map(functools.partial(_build_row, examples=_Quiet(examples), seq_len=seq_len, pad_id=pad_id,
                                  **_image_layout(examples, groups, vision)))
    read_options = read_options or grain.ReadOptions(num_threads=2, prefetch_buffer_size=4 * batch_size)
    return ds.to_iter_dataset(read_options).batch(batch_size, drop_remainder=True)

"""Data: files -> rows -> token ids + loss masks -> fixed-shape (packed) rows -> Grain batches.

What it is: the public names of `sources` (reading JSONL / Parquet / `datasets` folders),
`formats` (the TRL SFT row formats and masked segments -> ids and loss mask) and `pipeline` (truncation, padding,
first-fit packing, checkpointable Grain batches). See each module's docstring for the details
and `pipeline` for the batch field conventions.

What it is not: no hub downloads, no preference/RL data formats yet.
"""

from posttrain.data.formats import FORMATS, detect_format, encode_segments, tokenize_row
from posttrain.data.pipeline import (
    FIELDS,
    TRUNCATION,
    Example,
    batches,
    load_examples,
    pack_first_fit,
    to_arrays,
)
from posttrain.data.sources import read_rows

__all__ = [
    "FIELDS",
    "FORMATS",
    "TRUNCATION",
    "Example",
    "batches",
    "detect_format",
    "encode_segments",
    "load_examples",
    "pack_first_fit",
    "read_rows",
    "to_arrays",
    "tokenize_row",
]

"""Data sources: read raw rows (dicts) from a JSONL file, a Parquet file, or a `datasets` folder.

What it is: `read_rows(path)` streams `(row, where)` pairs, where `where` says where the row
came from so every later error can point at it:
  - `.jsonl` / `.json` (one JSON object per line): "FILE:LINE", LINE 1-based like an editor;
  - `.parquet` (read with pyarrow, one record batch at a time): "FILE:row N";
  - a folder written by `datasets.Dataset.save_to_disk`: "FOLDER:row N".
JSONL is read as UTF-8 (a UTF-8 byte-order mark is allowed); a file in another encoding (UTF-16,
Latin-1, ...) is an error naming FILE:LINE and saying to re-save it as UTF-8.
For Parquet and `datasets` folders N is 0-based, the index you would pass to `ds[N]` or
`df.iloc[N]` to look at the row.

What it is not: no tokenization or validation of columns (that is `formats.py`), no hub
downloads (`datasets.load_dataset` is never called), no sharding across hosts, and no
random access: rows are read once, in file order, by `pipeline.load_examples`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from posttrain.errors import PosttrainError

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
ACCEPTED = ("a .jsonl/.json file (one JSON object per line), a .parquet file, or a folder written by "
            "datasets' save_to_disk")

OnBadRow = Callable[[PosttrainError], None]


def read_rows(path, *, on_bad_row: OnBadRow | None = None) -> Iterator[tuple[dict, str]]:
    """Yield (row, where) for every row of `path`.

    A bad row (a line that is not JSON, or not an object) raises PosttrainError; when
    `on_bad_row` is given it is called with that error instead and reading goes on, because a
    generator that raises cannot be resumed and `load_examples(skip_bad_rows=True)` must be
    able to step over such lines too.
    """
    p = Path(path)
    if not p.exists():
        raise PosttrainError(f"data path {p} does not exist; point the dataset path at {ACCEPTED}")
    if p.is_dir():
        yield from _read_saved_dataset(p)
    elif p.suffix.lower() in JSONL_SUFFIXES:
        yield from _read_jsonl(p, on_bad_row)
    elif p.suffix.lower() in PARQUET_SUFFIXES:
        yield from _read_parquet(p)
    else:
        raise PosttrainError(f"data file {p} has an unknown extension {p.suffix!r}; use {ACCEPTED}")


def parse_rows(path, parse: Callable[[dict, str], Any], counts: dict, *,
               skip_bad_rows: bool = False) -> Iterator[tuple[Any, str]]:
    """(parse(row, where), where) for every row of `path`, counting rows in counts["rows"].

    A row that cannot be read or parsed (PosttrainError) raises, or with `skip_bad_rows` is skipped
    and counted in counts["skipped"]; the whole file then gets one warning naming the first such
    row (a bad export can have thousands). The loaders of every trainer's data use this."""
    first: list[str] = []

    def skip(err: PosttrainError) -> None:
        counts["skipped"] += 1
        if not first:
            first.append(str(err))

    def on_bad_row(err: PosttrainError) -> None:  # a line the source itself could not parse
        counts["rows"] += 1
        skip(err)

    for row, where in read_rows(path, on_bad_row=on_bad_row if skip_bad_rows else None):
        counts["rows"] += 1
        try:
            out = parse(row, where)
        except PosttrainError as err:
            if not skip_bad_rows:
                raise
            skip(err)
            continue
        yield out, where
    if first:
        warnings.warn(f"skipped {counts['skipped']} of {counts['rows']} rows of {path} that could not be used; "
                      f"the first: {first[0]}", stacklevel=3)


_BOMS = ((b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe\x00\x00", "UTF-32"), (b"\xff\xfe", "UTF-16"),
         (b"\xfe\xff", "UTF-16"))


def _not_utf8(path: Path, where: str, what: str) -> PosttrainError:
    return PosttrainError(f"{where}: {what}; posttrain reads text data as UTF-8: re-save {path} as UTF-8 (e.g. "
                          f"`iconv -f <its encoding> -t UTF-8`, or your editor's 'Save with encoding: UTF-8')")


def _decoded_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 file (a UTF-8 byte-order mark is allowed); another encoding raises,
    naming the file and line: UTF-16/32 (a byte-order mark, or NUL bytes) or bytes that are not UTF-8."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1:
                for bom, name in _BOMS:
                    if raw.startswith(bom):
                        raise _not_utf8(path, f"{path}:1", f"the file is {name}-encoded (byte-order mark)")
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            if b"\x00" in raw:
                raise _not_utf8(path, f"{path}:{number}", "the line holds NUL bytes (the file looks UTF-16 or "
                                "UTF-32 encoded)")
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _not_utf8(path, f"{path}:{number}", f"byte {err.start + 1} of the line is not UTF-8 "
                                f"({raw[err.start:err.start + 1]!r}: another encoding, e.g. Latin-1 or "
                                "Windows-1252)") from None


def _read_jsonl(path: Path, on_bad_row: OnBadRow | None) -> Iterator[tuple[dict, str]]:
    for number, line in _decoded_lines(path):
        if not line.strip():
            continue  # blank lines (often a trailing newline or two) are not rows
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise PosttrainError(
                    f"{where}: the line is a JSON {type(row).__name__}, not an object; each line "
                    f'must be one object such as {{"text": ...}} or {{"messages": [...]}}'
                )
        except json.JSONDecodeError as err:
            hint = ""
            if number == 1 and line.lstrip().startswith("["):
                # The most common mistake: a pretty-printed JSON array saved as .json.
                hint = " (the file looks like one JSON array; rewrite it with one object per line, JSONL)"
            bad = PosttrainError(
                f"{where}: the line is not valid JSON ({err.msg} at column {err.colno}){hint}; "
                f"fix or delete that line"
            )
            if on_bad_row is None:
                raise bad from err
            on_bad_row(bad)
            continue
        except PosttrainError as bad:
            if on_bad_row is None:
                raise
            on_bad_row(bad)
            continue
        yield row, where


def _read_parquet(path: Path) -> Iterator[tuple[dict, str]]:
    import pyarrow as pa  # imported here: only Parquet users pay for it
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise PosttrainError(
            f"{path} could not be read as a Parquet file: {err}; check it was written completely"
        ) from err
    index = 0
    # One record batch at a time, so a large file is never held in memory as Python objects.
    for batch in reader.iter_batches():
        for row in batch.to_pylist():
            yield row, f"{path}:row {index}"
            index += 1


def _read_saved_dataset(folder: Path) -> Iterator[tuple[dict, str]]:
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
        raise PosttrainError(
            f"{folder} holds a DatasetDict with splits {splits}; point the dataset path at one split's "
            f"folder, e.g. {folder / (splits[0] if splits else 'train')}"
        )
    if not (folder / "state.json").is_file():
        raise PosttrainError(
            f"{folder} is a folder but not one written by datasets' save_to_disk (no state.json); "
            f"use {ACCEPTED}"
        )
    import datasets  # imported here: it is slow to import and only this source needs it

    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as err:  # only datasets parsing the user's folder runs here
        raise PosttrainError(f"could not load the saved dataset in {folder}: {err}") from err
    # Iterating a Dataset yields plain Python dicts, decoded from its Arrow table lazily.
    for index, row in enumerate(ds):
        yield row, f"{folder}:row {index}"

"""Read raw rows from JSONL or Parquet files, each tagged with where it came from.

Rows are yielded as ``(location, row_or_error)``: the location is ``path:line`` for JSONL (1-based
line numbers, as an editor shows them) and ``path:row N`` for Parquet (1-based), so that every
problem reported later points at the exact place in the file. A JSONL line that is not valid
JSON, not a JSON object, or not UTF-8 text is yielded as a :class:`BadRow` instead of stopping
the read. A file that is not text at all (a NUL byte in its first block: a Parquet file, an
archive or a checkpoint under a ``.jsonl`` name) is refused at once, and so is a directory or an
unreadable file, each with the path named.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple, Union

from gspo_megatron.data.records import BadRow, DataLoadError

RawRow = Union[Dict[str, Any], BadRow]
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


BINARY_SNIFF_BYTES = 8192


def _refuse_binary(path: Path) -> None:
    with open(path, "rb") as f:
        head = f.read(BINARY_SNIFF_BYTES)
    if b"\0" in head:
        kind = " (it starts like a Parquet file)" if head.startswith(b"PAR1") else ""
        raise DataLoadError(f"{path}: binary data, not JSON Lines text{kind}; a dataset must be "
                            f"UTF-8 JSONL ({', '.join(JSONL_SUFFIXES)}) or Parquet "
                            f"({', '.join(PARQUET_SUFFIXES)})")


def _iter_jsonl(path: Path) -> Iterator[Tuple[str, RawRow]]:
    _refuse_binary(path)
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            location = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield location, BadRow(location, f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
                                                 f"column {exc.start + 1})")
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield location, BadRow(location, f"invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(row, dict):
                yield location, BadRow(location, f"expected a JSON object, got {type(row).__name__}")
                continue
            yield location, row


def _iter_parquet(path: Path) -> Iterator[Tuple[str, RawRow]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise DataLoadError(f"{path}: cannot read Parquet file: {exc}") from exc
    for row_no, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}:row {row_no}", row


def iter_raw_rows(path: Union[str, Path]) -> Iterator[Tuple[str, RawRow]]:
    """``(location, row)`` for every row of a ``.jsonl`` / ``.parquet`` file."""
    path = Path(path)
    if path.is_dir():
        raise DataLoadError(f"{path}: is a directory, not a dataset file")
    if not path.is_file():
        raise DataLoadError(f"{path}: dataset file not found")
    if not os.access(path, os.R_OK):
        raise DataLoadError(f"{path}: dataset file is not readable (permissions)")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _iter_jsonl(path)
    if suffix in PARQUET_SUFFIXES:
        return _iter_parquet(path)
    raise DataLoadError(f"{path}: unsupported dataset format '{suffix}' "
                        f"(expected one of {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)})")

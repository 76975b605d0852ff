"""Read raw rows from JSONL or Parquet files, each tagged with where it came from.

Rows are yielded as ``(location, row_or_error)``: the location is ``path:line`` for JSONL (1-based
line numbers, as an editor shows them) and ``path:row N`` for Parquet (1-based), so that every
problem reported later points at the exact place in the file. A JSONL line that is not valid
JSON, or not a JSON object, is yielded as a :class:`BadRow` instead of stopping the read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple, Union

from gspo_megatron.data.records import BadRow, DataLoadError

RawRow = Union[Dict[str, Any], BadRow]
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


def _iter_jsonl(path: Path) -> Iterator[Tuple[str, RawRow]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            location = f"{path}:{line_no}"
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
    if not path.is_file():
        raise DataLoadError(f"{path}: dataset file not found")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _iter_jsonl(path)
    if suffix in PARQUET_SUFFIXES:
        return _iter_parquet(path)
    raise DataLoadError(f"{path}: unsupported dataset format '{suffix}' "
                        f"(expected one of {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)})")

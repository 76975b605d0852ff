"""Load a prompt dataset (JSONL or Parquet) into rendered, tokenised :class:`PromptRecord` s.

Each row holds a prompt under ``DataConfig.prompt_key`` — a string, or chat messages (a list of
``{"role", "content"}``) — the reference answer under ``DataConfig.answer_key``, and optionally
``id`` and ``metadata``; any other column is kept in the record's metadata. When the tokenizer
has a chat template the prompt is rendered with it (a string becomes one user message, and
``DataConfig.chat_template_kwargs`` are the template's extra variables, e.g. Qwen3's
``enable_thinking``) and the generation prompt is appended; otherwise the raw string is tokenised
as is.

Robustness rules: a malformed row (bad JSON, missing key, wrong type, duplicate id) is logged
with its ``file:line`` and skipped; if more than ``max_bad_row_fraction`` of the rows are bad the
load stops with an error naming the file and the first bad lines, since such a file is more
likely the wrong file than a few broken rows. Prompts longer than ``max_prompt_tokens`` are
skipped and counted. A dataset left empty is an error.

    dataset = load_prompt_dataset("train.jsonl", tokenizer, cfg.data)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from gspo_megatron.data.readers import iter_raw_rows
from gspo_megatron.data.records import BadRow, DataLoadError, LoadStats, PromptRecord

logger = logging.getLogger(__name__)

ID_KEY = "id"
METADATA_KEY = "metadata"
MAX_BAD_ROWS_LOGGED = 20
MAX_BAD_ROWS_IN_ERROR = 5


class _RowError(ValueError):
    """A reason why one row is malformed (becomes a :class:`BadRow`)."""


@dataclass
class PromptDataset:
    """The loaded records of one file and what happened to its rows."""

    records: List[PromptRecord]
    stats: LoadStats

    def __len__(self) -> int:
        return len(self.records)


def _check_messages(value: Sequence[Any], key: str) -> List[Dict[str, str]]:
    if not value:
        raise _RowError(f"'{key}' is an empty message list")
    messages = []
    for i, msg in enumerate(value):
        if not isinstance(msg, Mapping):
            raise _RowError(f"'{key}[{i}]' must be an object with 'role' and 'content'")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise _RowError(f"'{key}[{i}]' needs string 'role' and 'content'")
        messages.append({"role": role, "content": content})
    return messages


def _prompt_field(row: Mapping[str, Any], key: str) -> Union[str, List[Dict[str, str]]]:
    if key not in row or row[key] is None:
        raise _RowError(f"missing prompt key '{key}'")
    value = row[key]
    if isinstance(value, str):
        if not value:
            raise _RowError(f"'{key}' is an empty string")
        return value
    if isinstance(value, (list, tuple)):
        return _check_messages(value, key)
    raise _RowError(f"'{key}' must be a string or a list of chat messages, "
                    f"got {type(value).__name__}")


def _answer_field(row: Mapping[str, Any], key: str) -> str:
    if key not in row or row[key] is None:
        raise _RowError(f"missing answer key '{key}'")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _RowError(f"'{key}' must be a string or a number, got {type(value).__name__}")
    return str(value)


def _metadata_field(row: Mapping[str, Any], used_keys: Sequence[str]) -> Dict[str, Any]:
    metadata = row.get(METADATA_KEY)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, Mapping):
        raise _RowError(f"'{METADATA_KEY}' must be an object, got {type(metadata).__name__}")
    extra = {k: v for k, v in row.items() if k not in used_keys and k not in metadata}
    return {**metadata, **extra}


def _id_field(row: Mapping[str, Any], location: str, path: Path) -> str:
    """The row's ``id``, else ``<file name>:<line>`` (``<file name>:row<N>`` for Parquet)."""
    value = row.get(ID_KEY)
    if value is None:
        where = location[len(str(path)) + 1:]
        return f"{path.name}:{where.replace(' ', '')}"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _RowError(f"'{ID_KEY}' must be a string or an integer, got {type(value).__name__}")
    return str(value)


def render_prompt(prompt: Union[str, List[Dict[str, str]]], tokenizer,
                  template_kwargs: Optional[Mapping[str, Any]] = None) -> str:
    """The text the model is given: chat template (with generation prompt, and
    ``template_kwargs`` as the template's extra variables) or the raw string."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **dict(template_kwargs or {}))
    if not isinstance(prompt, str):
        raise _RowError("chat messages need a tokenizer with a chat template")
    return prompt


def tokenize_prompt(text: str, tokenizer) -> List[int]:
    """Token ids of a rendered prompt; a chat template already placed any special tokens."""
    add_special = not getattr(tokenizer, "chat_template", None)
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])


def _fail_on_bad_rows(stats: LoadStats, max_fraction: float) -> None:
    if stats.num_bad and stats.bad_fraction > max_fraction:
        first = "\n  ".join(str(b) for b in stats.bad_rows[:MAX_BAD_ROWS_IN_ERROR])
        raise DataLoadError(
            f"{stats.path}: {stats.num_bad} of {stats.num_rows} rows are malformed "
            f"({stats.bad_fraction:.1%} > data.max_bad_row_fraction={max_fraction:.1%}); "
            f"first bad rows:\n  {first}")


def _record_bad(stats: LoadStats, bad: BadRow) -> None:
    stats.num_bad += 1
    stats.bad_rows.append(bad)
    if stats.num_bad <= MAX_BAD_ROWS_LOGGED:
        logger.warning("skipping malformed row %s", bad)


def _parse_row(row: Mapping[str, Any], location: str, path: Path, cfg,
               tokenizer) -> PromptRecord:
    prompt = _prompt_field(row, cfg.prompt_key)
    answer = _answer_field(row, cfg.answer_key)
    metadata = _metadata_field(row, (cfg.prompt_key, cfg.answer_key, ID_KEY, METADATA_KEY))
    prompt_id = _id_field(row, location, path)
    text = render_prompt(prompt, tokenizer, cfg.chat_template_kwargs)
    return PromptRecord(prompt_id=prompt_id, prompt_token_ids=tuple(tokenize_prompt(text, tokenizer)),
                        prompt_text=text, answer=answer, metadata=metadata)


def load_prompt_dataset(path: Union[str, Path], tokenizer, cfg) -> PromptDataset:
    """Load, validate, render and tokenise every row of ``path`` (``cfg`` is a ``DataConfig``)."""
    path = Path(path)
    stats = LoadStats(path=str(path))
    records: List[PromptRecord] = []
    seen_ids: Dict[str, str] = {}
    for location, row in iter_raw_rows(path):
        stats.num_rows += 1
        if isinstance(row, BadRow):
            _record_bad(stats, row)
            continue
        try:
            record = _parse_row(row, location, path, cfg, tokenizer)
            if record.prompt_id in seen_ids:
                raise _RowError(f"duplicate id '{record.prompt_id}' (first at {seen_ids[record.prompt_id]})")
        except _RowError as exc:
            _record_bad(stats, BadRow(location, str(exc)))
            continue
        seen_ids[record.prompt_id] = location
        if len(record.prompt_token_ids) > cfg.max_prompt_tokens:
            stats.num_too_long += 1
            continue
        records.append(record)
    _fail_on_bad_rows(stats, cfg.max_bad_row_fraction)
    stats.num_loaded = len(records)
    _check_not_empty(stats, cfg.max_prompt_tokens)
    logger.info("loaded %d prompts from %s (%d rows, %d malformed, %d longer than %d tokens)",
                stats.num_loaded, path, stats.num_rows, stats.num_bad, stats.num_too_long,
                cfg.max_prompt_tokens)
    return PromptDataset(records=records, stats=stats)


def _check_not_empty(stats: LoadStats, max_prompt_tokens: int) -> None:
    if stats.num_loaded:
        return
    if stats.num_rows == 0:
        raise DataLoadError(f"{stats.path}: dataset is empty (no rows)")
    raise DataLoadError(
        f"{stats.path}: no usable prompts: {stats.num_rows} rows, {stats.num_bad} malformed, "
        f"{stats.num_too_long} longer than data.max_prompt_tokens={max_prompt_tokens}")

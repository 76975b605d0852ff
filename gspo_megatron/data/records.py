"""Typed records of the prompt datasets and the errors and counts their loading produces.

``PromptRecord`` is the one type that crosses from ``data/`` into the rollout and the trainer:
a prompt already rendered (chat template or raw text) and tokenised, its reference answer for
the reward, and free-form metadata that is passed through to the reward function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple


class DataLoadError(ValueError):
    """A dataset that cannot be used: missing or unreadable file, too many bad rows, empty."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a dataset, ready for generation."""

    prompt_id: str
    """Unique within the dataset: the row's ``id`` or ``<file name>:<line>``."""
    prompt_token_ids: Tuple[int, ...]
    """The rendered prompt, tokenised (generation continues right after the last token)."""
    prompt_text: str
    """The rendered prompt text (after the chat template, when one was applied)."""
    answer: str
    """Reference answer handed to the reward function."""
    metadata: Dict[str, Any] = field(default_factory=dict)
    """The row's ``metadata`` mapping plus any extra columns; passed to the reward function."""


@dataclass(frozen=True)
class BadRow:
    """A malformed row: where it is (``file:line`` or ``file:row N``) and what is wrong."""

    location: str
    reason: str

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"


@dataclass
class LoadStats:
    """What happened to the rows of one file."""

    path: str
    num_rows: int = 0
    """Rows read (blank JSONL lines excluded)."""
    num_loaded: int = 0
    num_bad: int = 0
    num_too_long: int = 0
    """Prompts longer than ``max_prompt_tokens``, skipped."""
    bad_rows: List[BadRow] = field(default_factory=list)

    @property
    def bad_fraction(self) -> float:
        return self.num_bad / self.num_rows if self.num_rows else 0.0

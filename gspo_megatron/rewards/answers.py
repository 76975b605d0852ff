"""Find and normalise the final answer in a model response.

Used by the ``exact_match`` and ``format`` rewards. The final answer is the content of the last
``\\boxed{...}`` (braces matched, so ``\\boxed{\\frac{1}{2}}`` works), else the text after the last
final-answer marker (``####``, ``final answer:``, ``the answer is``, ``answer:``), else the whole
response. Normalisation strips what does not change the value: surrounding ``$`` and spaces,
``\\text{...}`` wrappers, a trailing period, thousands separators, letter case, repeated spaces.
"""

from __future__ import annotations

import re
from typing import Optional

BOXED_COMMANDS = ("\\boxed", "\\fbox")
_MARKERS = re.compile(r"(?:####|final answer\s*(?:is)?\s*[:：]?|the answer is\s*:?|answer\s*:)",
                      re.IGNORECASE)
_TEXT_WRAPPER = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


def _matching_brace(text: str, open_index: int) -> Optional[int]:
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def extract_last_boxed(text: str) -> Optional[str]:
    """Content of the last well-formed ``\\boxed{...}`` / ``\\fbox{...}``, or None."""
    starts = [(text.rfind(cmd + "{"), cmd) for cmd in BOXED_COMMANDS]
    candidates = sorted(((i, cmd) for i, cmd in starts if i >= 0), reverse=True)
    for start, cmd in candidates:
        open_index = start + len(cmd)
        close = _matching_brace(text, open_index)
        if close is not None:
            return text[open_index + 1:close]
    return None


def extract_after_marker(text: str) -> Optional[str]:
    """Text after the last final-answer marker (first line of it), or None."""
    matches = list(_MARKERS.finditer(text))
    if not matches:
        return None
    tail = text[matches[-1].end():].strip()
    return tail.splitlines()[0] if tail else None


def extract_final_answer(text: str) -> str:
    """Boxed content, else text after a marker, else the whole text (not yet normalised)."""
    for extract in (extract_last_boxed, extract_after_marker):
        found = extract(text)
        if found is not None:
            return found
    return text


def normalize_answer(answer: str) -> str:
    """Canonical form used for exact comparison."""
    text = answer.strip()
    text = _TEXT_WRAPPER.sub(r"\1", text)
    for _ in range(2):  # "$42$." and "42.$" both reduce to "42"
        text = text.strip().rstrip(".").strip().strip("$")
    text = _THOUSANDS.sub("", text)
    text = re.sub(r"\s+", " ", text)
    return text.lower()

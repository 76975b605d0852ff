"""Rewards for a chat model's responses, parsed as a user of Qwen3 parses them.

A Qwen3 response may open with a thinking block; what the user reads is the text after its last
``</think>`` (the rollout decodes with ``skip_special_tokens=True``, which keeps ``<think>`` and
``</think>``: they are added tokens but not special ones). A response cut off inside an unclosed
``<think>`` has no answer yet. In the non-thinking mode (``enable_thinking=False``) the chat
template already ends the prompt with an empty think block, so the response is the answer.

``final_number`` is the task's real reward: the answer is the last ``\\boxed{...}``, else the
text after a final-answer marker (``the answer is``, ``answer:``, ...), else the last number of
the visible text, the way GSM8K-style evaluations read a reply; 1.0 when it equals the reference.

``brevity`` is not a quality signal: it exists because a randomly initialised model (the real
widths' CPU runs) never answers an arithmetic question, so ``final_number`` gives it 0 on every
sample and GSPO has no advantage to push on. ``1 / (1 + characters / 64)`` of the whole response
(thinking included, so an unclosed ``<think>`` is no shortcut) differs between the samples of one
prompt even for random weights (tokens are 1 to 16+ characters long, and an early eos ends one
sample sooner than another), so the reward moves as soon as the policy moves.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

from gspo_megatron.rewards.answers import extract_after_marker, extract_last_boxed, normalize_answer
from gspo_megatron.rewards.registry import register_reward

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
BREVITY_SCALE_CHARS = 64
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def visible_answer(response: str) -> Optional[str]:
    """The text after the thinking block; None while a ``<think>`` is still open."""
    if THINK_CLOSE in response:
        return response.rsplit(THINK_CLOSE, 1)[1].strip()
    if THINK_OPEN in response:
        return None
    return response.strip()


def final_answer(text: str) -> Optional[str]:
    """Last ``\\boxed{}``, else the text after the last answer marker, else the last number."""
    for extract in (extract_last_boxed, extract_after_marker):
        found = extract(text)
        if found is not None:
            return found
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


@register_reward("final_number")
def final_number_reward(response: str, answer: str, metadata: Optional[Mapping] = None) -> float:
    """1.0 when the final answer after the thinking block equals the reference answer."""
    visible = visible_answer(response)
    found = final_answer(visible) if visible else None
    if found is None:
        return 0.0
    return 1.0 if normalize_answer(found) == normalize_answer(str(answer)) else 0.0


@register_reward("brevity")
def brevity_reward(response: str, answer: str = "", metadata: Optional[Mapping] = None) -> float:
    """``1 / (1 + len(response) / 64)``: shorter is better; not a measure of correctness."""
    return 1.0 / (1.0 + len(response.strip()) / BREVITY_SCALE_CHARS)

"""Built-in reward functions: ``math_verify``, ``exact_match``, ``format``, ``tiny_addition`` and
``tiny_repeat``.

All return 1.0 or 0.0. ``math_verify`` checks mathematical equivalence with the math-verify
package (``1/2`` equals ``\\frac{1}{2}`` equals ``0.5``). math-verify bounds its own run time with
``signal.alarm``, which only works in a process's main thread; the :class:`RewardRunner` calls
rewards from worker threads, so the package's timeouts are switched off here
(``parsing_timeout=None``, ``timeout_seconds=None``) and the runner enforces
``RewardConfig.timeout_s`` itself.

``tiny_addition`` scores the tiny CPU task (``tiny_task/task.py``: ``"12+34="`` -> ``"46"``): 1.0
when the digits generated before the tokenizer's eos token (or the end of the text) are exactly
the answer. ``tiny_repeat`` scores the long-tail task (``tiny_task/repeat_task.py``: ``"7*12="``
-> twelve 7s) the same way: one digit too many or too few is as wrong as a wrong digit. Both read
only the task's vocabulary (``tiny_task/vocab.py``), a leaf module.
"""

from __future__ import annotations

from typing import Mapping, Optional

from gspo_megatron.rewards.answers import (
    extract_final_answer,
    extract_last_boxed,
    normalize_answer,
)
from gspo_megatron.rewards.registry import register_reward
from gspo_megatron.tiny_task.vocab import EOS_TOKEN


def _gold_for_math_verify(answer: str) -> str:
    """Reference answers are often bare (``3/4``); wrap them so the LaTeX parser sees math."""
    if "\\boxed" in answer or "$" in answer:
        return answer
    return f"${answer}$"


@register_reward("math_verify")
def math_verify_reward(response: str, answer: str, metadata: Optional[Mapping] = None) -> float:
    """1.0 when the response's final answer is mathematically equal to ``answer``."""
    from math_verify import parse, verify

    gold = parse(_gold_for_math_verify(answer), parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    predicted = parse(response, parsing_timeout=None)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0


@register_reward("exact_match")
def exact_match_reward(response: str, answer: str, metadata: Optional[Mapping] = None) -> float:
    """1.0 when the normalised final answers of response and reference are equal."""
    predicted = normalize_answer(extract_final_answer(response))
    expected = normalize_answer(extract_final_answer(answer))
    return 1.0 if predicted and predicted == expected else 0.0


@register_reward("format")
def format_reward(response: str, answer: str = "", metadata: Optional[Mapping] = None) -> float:
    """1.0 when the response ends its reasoning with exactly one non-empty ``\\boxed{...}``."""
    content = extract_last_boxed(response)
    if content is None or not content.strip():
        return 0.0
    return 1.0 if response.count("\\boxed{") == 1 else 0.0


def extract_generated_digits(response: str) -> str:
    """The response up to the first eos token (if the decoder kept it), stripped of spaces."""
    return response.split(EOS_TOKEN, 1)[0].strip()


def _digits_match(response: str, answer: str) -> float:
    generated = extract_generated_digits(response)
    return 1.0 if generated.isdigit() and generated == str(answer).strip() else 0.0


@register_reward("tiny_addition")
def addition_reward(response: str, answer: str, metadata: Optional[Mapping] = None) -> float:
    """1.0 when the digits before eos are exactly the answer's digits, else 0.0."""
    return _digits_match(response, answer)


@register_reward("tiny_repeat")
def repeat_reward(response: str, answer: str, metadata: Optional[Mapping] = None) -> float:
    """1.0 when the text before eos is exactly the answer (the digit, ``count`` times), else 0.0.

    The scorer decodes without special tokens, so a response cut at ``rollout.max_new_tokens``
    reads like one that stopped: the task's config leaves room for the longest answer and eos,
    so a cut response is always too long and scores 0."""
    return _digits_match(response, answer)

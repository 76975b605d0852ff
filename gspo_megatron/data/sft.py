"""Turn prompt records into supervised (cold-start) examples: token ids plus a loss mask.

The GSPO paper starts RL from a cold-start fine-tuned model. For a dataset whose reference
answer is itself a complete response (the tiny addition task: the answer digits), one SFT
example is ``prompt tokens + response tokens + eos`` with the loss on the response and eos only;
``format_response`` lets a caller wrap a bare answer (e.g. ``"\\boxed{" + a + "}"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from gspo_megatron.data.records import PromptRecord


@dataclass(frozen=True)
class SFTExample:
    """One supervised sequence; ``loss_mask[t]`` says whether token ``t`` is a target.

    A learner predicting token ``t`` from the prefix ``[:t]`` uses ``loss_mask[1:]`` against
    the shifted logits; the prompt tokens are never targets.
    """

    prompt_id: str
    token_ids: Tuple[int, ...]
    loss_mask: Tuple[int, ...]

    @property
    def num_target_tokens(self) -> int:
        return sum(self.loss_mask)


def build_sft_examples(records: Sequence[PromptRecord], tokenizer,
                       format_response: Optional[Callable[[str], str]] = None,
                       append_eos: bool = True) -> List[SFTExample]:
    """One :class:`SFTExample` per record: rendered prompt + (formatted) answer [+ eos]."""
    if append_eos and tokenizer.eos_token_id is None:
        raise ValueError("append_eos=True needs a tokenizer with an eos token")
    examples = []
    for record in records:
        response = format_response(record.answer) if format_response else record.answer
        response_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
        if append_eos:
            response_ids.append(tokenizer.eos_token_id)
        prompt_ids = list(record.prompt_token_ids)
        examples.append(SFTExample(
            prompt_id=record.prompt_id,
            token_ids=tuple(prompt_ids + response_ids),
            loss_mask=tuple([0] * len(prompt_ids) + [1] * len(response_ids))))
    return examples

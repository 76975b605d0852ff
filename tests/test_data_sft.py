"""SFT examples: prompt + answer + eos, loss on the response only."""

from __future__ import annotations

from gspo_megatron.data import PromptRecord, build_sft_examples
from gspo_megatron.tiny_task.tokenizer import build_char_tokenizer


def test_sft_example_masks_prompt_and_targets_answer_and_eos():
    tok = build_char_tokenizer()
    prompt_ids = tuple(tok("12+34=")["input_ids"])
    record = PromptRecord("p", prompt_ids, "12+34=", "46")
    (example,) = build_sft_examples([record], tok)
    assert tok.decode(list(example.token_ids)) == "12+34=46" + tok.eos_token
    assert example.loss_mask == (0,) * 6 + (1, 1, 1)
    assert example.token_ids[-1] == tok.eos_token_id and example.num_target_tokens == 3
    (wrapped,) = build_sft_examples([record], tok, format_response=lambda a: " " + a,
                                    append_eos=False)
    assert tok.decode(list(wrapped.token_ids)) == "12+34= 46" and wrapped.num_target_tokens == 3

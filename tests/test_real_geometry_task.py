"""The real-format task: arithmetic questions in words, loaded through the real tokenizer's chat
template in non-thinking mode (21 tokens for two two-digit operands, ending in the empty think
block), scored by
final_number; the same seeds as the tiny task, train and eval disjoint."""

from __future__ import annotations

import json

from gspo_megatron.config.schema import DataConfig
from gspo_megatron.data import load_prompt_dataset
from gspo_megatron.real_geometry.task import write_question_datasets
from gspo_megatron.rewards import get_reward_fn
from gspo_megatron.tiny_task.task import AdditionTaskConfig
from tests.qwen3_assets import qwen3_tokenizer_dir  # noqa: F401

SMALL = AdditionTaskConfig(num_train=40, num_eval=10)


def test_rows_ask_each_sum_in_words(tmp_path):
    train, held_out = write_question_datasets(tmp_path, SMALL)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    eval_rows = [json.loads(line) for line in held_out.read_text().splitlines()]
    assert len(rows) == 40 and len(eval_rows) == 10
    row = rows[0]
    a, b = row["metadata"]["a"], row["metadata"]["b"]
    assert row["prompt"] == f"What is {a}+{b}?" and row["answer"] == str(a + b)
    assert {r["prompt"] for r in rows}.isdisjoint(r["prompt"] for r in eval_rows)
    assert write_question_datasets(tmp_path / "again", SMALL)[0].read_bytes() == train.read_bytes()


def test_loads_through_the_real_chat_template_without_thinking(tmp_path, qwen3_tokenizer_dir):  # noqa: F811
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    train, _ = write_question_datasets(tmp_path, SMALL)
    cfg = DataConfig(chat_template_kwargs={"enable_thinking": False})
    records = load_prompt_dataset(train, tok, cfg).records
    assert len(records) == 40
    for r in records:  # one token per digit: 21 tokens when both operands have two digits
        digits = len(str(r.metadata["a"])) + len(str(r.metadata["b"]))
        assert len(r.prompt_token_ids) == 17 + digits
    first = records[0]
    assert first.prompt_text == (f"<|im_start|>user\nWhat is {first.metadata['a']}+"
                                 f"{first.metadata['b']}?<|im_end|>\n<|im_start|>assistant\n"
                                 "<think>\n\n</think>\n\n")
    thinking = load_prompt_dataset(train, tok, DataConfig()).records[0]
    assert thinking.prompt_text.endswith("<|im_start|>assistant\n")  # the thinking mode's prompt
    reward = get_reward_fn("final_number")
    assert reward(f"The answer is {first.answer}.", first.answer, first.metadata) == 1.0

"""Repeat task: deterministic disjoint splits, the long-tail length spread of every block, and
dataset files that load through the prompt loader and the SFT example builder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gspo_megatron.config.schema import DataConfig
from gspo_megatron.data import load_prompt_dataset
from gspo_megatron.data.sft import build_sft_examples
from gspo_megatron.tiny_task.repeat_task import (
    RepeatProblem,
    RepeatTaskConfig,
    count_at_quantile,
    make_splits,
    write_repeat_datasets,
)
from gspo_megatron.tiny_task.tokenizer import build_char_tokenizer
from gspo_megatron.tiny_task.vocab import ALPHABET


def _nearest_rank(values, q):
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def test_problem_prompt_and_answer():
    assert (RepeatProblem(7, 12).prompt, RepeatProblem(7, 12).answer) == ("7*12=", "7" * 12)
    assert (RepeatProblem(0, 1).prompt, RepeatProblem(0, 1).answer) == ("0*01=", "0")
    assert set(RepeatProblem(3, 40).prompt) <= set(ALPHABET)


def test_splits_are_deterministic_disjoint_and_in_range():
    cfg = RepeatTaskConfig()
    train, held_out = make_splits(cfg)
    assert (train, held_out) == make_splits(cfg)
    assert (len(train), len(held_out)) == (cfg.num_train, cfg.num_eval)
    train_pairs, eval_pairs = ({(p.digit, p.count) for p in s} for s in (train, held_out))
    assert not train_pairs & eval_pairs
    assert all(cfg.min_count <= p.count <= cfg.max_count and 0 <= p.digit <= 9
               for p in train + held_out)
    # every count is held out for num_eval_digits digits and trained on with the other 8
    assert len(train_pairs) > 300 and {n for _, n in train_pairs} == set(range(1, 41))
    # the eval split does not depend on the train split's size
    assert make_splits(RepeatTaskConfig(num_train=32))[1] == held_out


def test_every_block_spans_the_long_tail_by_construction():
    cfg = RepeatTaskConfig()
    train, held_out = make_splits(cfg)
    for problems in (train, held_out):
        for start in range(0, len(problems), cfg.block_size):
            counts = [p.count for p in problems[start:start + cfg.block_size]]
            # one count per equal-probability stratum of the log-uniform distribution
            for i, n in enumerate(sorted(counts)):
                assert count_at_quantile(i / 32, cfg) <= n <= count_at_quantile((i + 1) / 32, cfg)
            responses = [n + 1 for n in counts]  # answer + eos
            assert min(counts) == 1 and max(counts) >= 36
            assert max(responses) / min(responses) >= 18.5
            assert _nearest_rank(responses, 0.9) / _nearest_rank(responses, 0.1) >= 13


def test_length_distribution_is_log_uniform_with_a_long_tail():
    cfg = RepeatTaskConfig()
    # P(n = k) = log((k + 1) / k) / log(41): every doubling of the length about equally likely
    assert [count_at_quantile(q, cfg) for q in (0.0, 0.5, 0.9, 0.999)] == [1, 6, 28, 40]
    counts = [p.count for p in make_splits(cfg)[0]]
    assert counts.count(1) / len(counts) == pytest.approx(math.log(2) / math.log(41), abs=0.01)
    p_40 = math.log(41 / 40) / math.log(41)
    assert counts.count(40) / len(counts) == pytest.approx(p_40, abs=0.005)
    assert sorted(counts)[len(counts) // 2] == 6                     # median
    assert sum(n >= 28 for n in counts) / len(counts) == pytest.approx(0.10, abs=0.01)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_train": 100}, "multiple of block_size"),
    ({"num_eval": 0}, "multiple of block_size"),
    ({"max_count": 100}, "max_count <= 99"),
    ({"min_count": 5, "max_count": 5}, "min_count < max_count"),
    ({"num_eval_digits": 10}, "num_eval_digits"),
])
def test_config_refuses_what_would_break_the_blocks_or_the_prompt(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RepeatTaskConfig(**kwargs)


def test_dataset_files_load_and_become_sft_examples(tmp_path: Path):
    cfg = RepeatTaskConfig(num_train=64, num_eval=32)
    train_path, eval_path = write_repeat_datasets(tmp_path, cfg)
    first = json.loads(train_path.read_text().splitlines()[0])
    assert set(first) == {"id", "prompt", "answer", "metadata"}
    assert first["answer"] == str(first["metadata"]["digit"]) * first["metadata"]["count"]
    again = write_repeat_datasets(tmp_path / "again", cfg)
    assert [p.read_bytes() for p in again] == [train_path.read_bytes(), eval_path.read_bytes()]
    tok = build_char_tokenizer()
    ds = load_prompt_dataset(train_path, tok, DataConfig(max_prompt_tokens=5))
    assert len(ds) == 64 and ds.stats.num_bad == 0 and ds.stats.num_too_long == 0
    assert all(len(r.prompt_token_ids) == 5 for r in ds.records)
    for record, example in zip(ds.records, build_sft_examples(ds.records, tok)):
        count = record.metadata["count"]
        assert example.num_target_tokens == count + 1  # the digits and eos
        assert example.token_ids[-1] == tok.eos_token_id

"""Addition task: deterministic disjoint splits and dataset files."""

from __future__ import annotations

import json

from gspo_megatron.config.schema import DataConfig
from gspo_megatron.data import load_prompt_dataset
from gspo_megatron.tiny_task.task import (
    AdditionProblem,
    AdditionTaskConfig,
    make_splits,
    write_task_datasets,
)
from gspo_megatron.tiny_task.tokenizer import build_char_tokenizer


def test_splits_are_deterministic_disjoint_and_correct():
    cfg = AdditionTaskConfig(num_train=300, num_eval=50)
    train, held_out = make_splits(cfg)
    assert (train, held_out) == make_splits(cfg)
    assert len(train) == 300 and len(held_out) == 50
    assert not {(p.a, p.b) for p in train} & {(p.a, p.b) for p in held_out}
    assert all(0 <= p.a < 100 and 0 <= p.b < 100 for p in train + held_out)
    assert make_splits(AdditionTaskConfig(num_train=10, num_eval=50))[1] == held_out
    problem = AdditionProblem(57, 68)
    assert (problem.prompt, problem.answer) == ("57+68=", "125")


def test_dataset_files_load_through_the_prompt_loader(tmp_path):
    train_path, eval_path = write_task_datasets(tmp_path, AdditionTaskConfig(num_train=20, num_eval=5))
    first = json.loads(train_path.read_text().splitlines()[0])
    assert set(first) == {"id", "prompt", "answer", "metadata"}
    assert str(first["metadata"]["a"] + first["metadata"]["b"]) == first["answer"]
    tok = build_char_tokenizer()
    ds = load_prompt_dataset(eval_path, tok, DataConfig(max_prompt_tokens=8))
    assert len(ds) == 5 and ds.stats.num_bad == 0
    record = ds.records[0]
    assert tok.decode(list(record.prompt_token_ids)) == record.prompt_text
    assert record.prompt_text.endswith("=")


def test_default_datasets_are_the_recorded_runs_bytes(tmp_path):
    """The numbers in docs/tiny_cpu_run.md were measured on exactly these files."""
    import hashlib

    paths = write_task_datasets(tmp_path, AdditionTaskConfig())
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths] == [
        "148adcaafdfc8d1da8e0605dbbe390570e0cd2d9c9598db5e29aa6089ec65db5",
        "efe481212a7ce1d6a453eee9d731775a953fa9c0b11a142c34ec294a4a5f5b5d"]

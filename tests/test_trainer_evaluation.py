"""Held-out evaluation: near-greedy sampling scored by prompt id, accuracy counts reward >= 1;
and the before / after table that ends a run."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from gspo_megatron.config.schema import GSPOConfig
from gspo_megatron.data.records import PromptRecord
from gspo_megatron.rollout.types import Sample
from gspo_megatron.trainer.evaluation import EVAL_TEMPERATURE, before_after_table, evaluate_accuracy


class _Engine:
    def generate(self, requests, params):
        assert params.temperature == EVAL_TEMPERATURE and params.stop_token_ids == (2,)
        assert all(r.n == 1 for r in requests)
        return sorted((Sample(r.prompt_id, 0, list(r.prompt_token_ids), [5], [-0.1], "stop", 0.0)
                       for r in requests), key=lambda s: s.prompt_id)


class _Scorer:
    def score(self, samples, records_by_id):
        return [{"x": 1.0, "y": 0.5, "z": 0.0}[records_by_id[s.prompt_id].answer] for s in samples]


class _Tokenizer:
    eos_token_id = 2


def test_accuracy_counts_full_rewards_of_each_prompt():
    prompts = [PromptRecord(pid, (1, 3), "q", answer) for pid, answer in
               (("p2", "x"), ("p0", "y"), ("p1", "x"), ("p3", "z"))]
    out = evaluate_accuracy(_Engine(), prompts, _Scorer(), _Tokenizer(),
                            OmegaConf.structured(GSPOConfig))
    assert out["eval/accuracy"] == 0.5 and out["eval/num_prompts"] == 4.0
    assert out["eval/reward_mean"] == pytest.approx(2.5 / 4)


def test_before_after_table_shows_first_and_last_evaluation():
    history = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "reward/mean": 0.5},
               {"step": 2, "eval/accuracy": 0.75}]
    table = before_after_table(history).splitlines()
    assert table[0].split() == ["metric", "step", "0", "step", "2"]
    assert table[1].split() == ["eval/accuracy", "0.2500", "0.7500"]
    assert before_after_table([{"step": 1, "reward/mean": 0.1}]) == ""

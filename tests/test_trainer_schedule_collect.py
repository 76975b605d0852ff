"""One rollout batch against a scripted engine and reward: groups kept in the prompts' order with
their advantages, dynamic sampling dropping and refilling zero-variance groups, the metrics, and
the error when every round comes back without signal."""

from __future__ import annotations

from typing import Dict, List

import pytest
from omegaconf import OmegaConf

from gspo_megatron.config.schema import GSPOConfig
from gspo_megatron.data.records import PromptRecord
from gspo_megatron.rollout.types import Sample
from gspo_megatron.trainer.schedule.collect import collect_rollout, generation_seed

N = 2  # samples per prompt


class _Sampler:
    def __init__(self, num_prompts: int) -> None:
        self.records = [PromptRecord(f"p{i}", (1, 2 + i), f"q{i}", "a") for i in range(num_prompts)]
        self.cursor = 0

    def next_batch(self, k: int) -> List[PromptRecord]:
        out, self.cursor = self.records[self.cursor:self.cursor + k], self.cursor + k
        return out


class _Metrics:
    def as_dict(self) -> Dict[str, float]:
        return {"rollout/tokens_per_s": 7.0, "rollout/other": 1.0}


class _Engine:
    """Answers in reverse key order (the loop must regroup by prompt); remembers the seeds."""

    def __init__(self) -> None:
        self.metrics = _Metrics()
        self.seeds: List[int] = []

    def generate(self, requests, params) -> List[Sample]:
        self.seeds.append(params.seed)
        assert params.stop_token_ids == (9,)
        out = [Sample(r.prompt_id, i, list(r.prompt_token_ids), [5] * (i + 1), [-0.5] * (i + 1),
                      "length" if i else "stop", 0.0) for r in requests for i in range(r.n)]
        return out[::-1]


class _Scorer:
    def __init__(self, rewards: Dict[str, List[float]]) -> None:
        self.rewards = rewards

    def score(self, samples, records_by_id) -> List[float]:
        assert all(s.prompt_id in records_by_id for s in samples)
        return [self.rewards[s.prompt_id][s.sample_index] for s in samples]

    def last_stats(self) -> Dict[str, float]:
        return {"reward/num_errors": 0.0}


class _Tokenizer:
    eos_token_id = 9


def _cfg(dynamic: bool, max_rounds: int = 3, num_prompts: int = 3):
    cfg = OmegaConf.structured(GSPOConfig)
    cfg.rollout.n_samples_per_prompt = N
    cfg.batch.num_prompts_per_step = num_prompts
    cfg.algo.dynamic_sampling.enabled = dynamic
    cfg.algo.dynamic_sampling.max_rounds = max_rounds
    cfg.algo.advantage = "group_mean"
    return cfg


REWARDS = {"p0": [1.0, 1.0], "p1": [0.0, 1.0], "p2": [0.0, 0.0], "p3": [1.0, 0.0],
           "p4": [0.5, 0.0], "p5": [1.0, 1.0]}


def test_without_dynamic_sampling_every_group_is_kept_with_zero_advantage_when_flat():
    engine, sampler = _Engine(), _Sampler(6)
    out = collect_rollout(sampler, engine, _Scorer(REWARDS), _Tokenizer(), _cfg(False), step=4)
    assert [s.key for s in out.samples] == [(f"p{g}", i) for g in range(3) for i in range(N)]
    assert out.rewards == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert out.advantages == [0.0, 0.0, -0.5, 0.5, 0.0, 0.0]
    assert out.num_prompts_drawn == 3 and sampler.cursor == 3
    assert engine.seeds == [generation_seed(_cfg(False).trainer.seed, 4, 0)]
    m = out.metrics
    assert m["rollout/dropped_groups"] == 0.0
    assert m["rollout/zero_variance_group_frac"] == pytest.approx(2 / 3)
    assert m["reward/mean"] == pytest.approx(0.5)
    assert m["rollout/num_sequences"] == 6.0 and m["rollout/truncated_frac"] == 0.5
    assert m["rollout/response_len_mean"] == 1.5 and m["rollout/response_len_max"] == 2.0
    assert (m["rollout/response_len_min"], m["rollout/response_len_p10"],
            m["rollout/response_len_p90"]) == (1.0, 1.0, 2.0)
    assert m["rollout/tokens_per_s"] == 7.0 and "rollout/other" not in m
    assert m["reward/num_errors"] == 0.0


def test_dynamic_sampling_drops_flat_groups_and_refills_them_in_later_rounds():
    engine, sampler = _Engine(), _Sampler(6)
    cfg = _cfg(True)
    out = collect_rollout(sampler, engine, _Scorer(REWARDS), _Tokenizer(), cfg, step=2)
    # Round 0 draws p0..p2 and keeps p1; round 1 draws the 2 missing groups, p3 and p4.
    assert [s.prompt_id for s in out.samples[::N]] == ["p1", "p3", "p4"]
    assert out.advantages == [-0.5, 0.5, 0.5, -0.5, 0.25, -0.25]
    assert out.num_prompts_drawn == 5 and sampler.cursor == 5
    assert engine.seeds == [generation_seed(cfg.trainer.seed, 2, r) for r in (0, 1)]
    assert sorted(out.group_rewards) == ["p0", "p1", "p2", "p3", "p4"]
    assert out.group_rewards["p2"] == [0.0, 0.0]  # dropped groups still reach the sampler
    assert out.metrics["rollout/dropped_groups"] == 2.0
    assert out.metrics["rollout/zero_variance_group_frac"] == pytest.approx(2 / 5)
    assert out.metrics["reward/mean"] == pytest.approx(4.5 / 10)


def test_dynamic_sampling_stops_after_max_rounds_with_fewer_groups():
    rewards = {**REWARDS, "p3": [0.0, 0.0], "p4": [1.0, 1.0]}
    out = collect_rollout(_Sampler(6), _Engine(), _Scorer(rewards), _Tokenizer(),
                          _cfg(True, max_rounds=1), step=0)
    assert [s.prompt_id for s in out.samples[::N]] == ["p1"]
    assert out.num_prompts_drawn == 5 and out.metrics["rollout/dropped_groups"] == 4.0


def test_a_batch_without_any_signal_is_an_error_naming_the_switch():
    flat = {f"p{i}": [1.0, 1.0] for i in range(6)}
    with pytest.raises(RuntimeError, match="disable algo.dynamic_sampling"):
        collect_rollout(_Sampler(6), _Engine(), _Scorer(flat), _Tokenizer(),
                        _cfg(True, max_rounds=1), step=0)


class _WrappingSampler(_Sampler):
    """Starts over at the end of its records (a new epoch), so a prompt can come back."""

    def next_batch(self, k: int) -> List[PromptRecord]:
        out = [self.records[(self.cursor + i) % len(self.records)] for i in range(k)]
        self.cursor += k
        return out


def test_a_prompt_drawn_twice_in_a_step_keeps_both_groups_rewards():
    """Issue 51: ``group_rewards`` was keyed by prompt id with the last group's rewards, so the
    query-set refresh judged a prompt drawn twice (dynamic sampling's rounds across an epoch's
    end) by one group. p1 is drawn in both rounds: all four of its rewards are kept."""
    engine, sampler = _Engine(), _WrappingSampler(3)
    out = collect_rollout(sampler, engine, _Scorer(REWARDS), _Tokenizer(), _cfg(True), step=1)
    # rounds: p0 (flat) p1 p2 (flat) | p0 (flat) p1 | p2 (flat) | p0 (flat): draws 0..6
    assert sampler.cursor == 7 and [s.prompt_id for s in out.samples[::N]] == ["p1", "p1"]
    assert out.group_rewards["p1"] == [0.0, 1.0, 0.0, 1.0]
    assert out.group_rewards["p0"] == [1.0] * 6 and out.group_rewards["p2"] == [0.0] * 4

"""RolloutScorer: responses decoded without special tokens, scored against their own prompt's
answer and metadata, failures counted in the stats it reports."""

from __future__ import annotations

from gspo_megatron.data.records import PromptRecord
from gspo_megatron.rewards.runner import RewardRunner
from gspo_megatron.rewards.scorer import RolloutScorer
from gspo_megatron.rollout.types import Sample


class _Tokenizer:
    """Token id -> one character; id 0 is a special token."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = "".join("<s>" if i == 0 else str(i) for i in ids)
        return text.replace("<s>", "") if skip_special_tokens else text


def _reward(response, answer, metadata=None):
    if response == "9":
        raise RuntimeError("verifier crashed")
    return float(response == answer) + metadata.get("bonus", 0.0)


def test_each_sample_is_scored_against_its_own_prompt():
    records = {"a": PromptRecord("a", (1,), "1+1=", "2"),
               "b": PromptRecord("b", (1,), "2+1=", "3", metadata={"bonus": 0.5})}
    samples = [Sample("b", 0, [1], [3, 0], [-0.1, -0.1], "stop", 0.0),
               Sample("a", 0, [1], [2], [-0.1], "stop", 0.0),
               Sample("a", 1, [1], [9], [-0.1], "stop", 0.0)]
    scorer = RolloutScorer(RewardRunner(_reward, timeout_s=5.0, num_workers=1), _Tokenizer())
    assert scorer.score(samples, records) == [1.5, 1.0, 0.0]
    stats = scorer.last_stats()
    assert stats["reward/num_errors"] == 1.0 and stats["reward/num_timeouts"] == 0.0
    stats["reward/num_errors"] = 7.0  # a copy: the scorer's own counters stay
    assert scorer.last_stats()["reward/num_errors"] == 1.0

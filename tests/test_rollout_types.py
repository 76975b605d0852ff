"""Tests of the trainer <-> engine contract in gspo_megatron/rollout/types.py."""

from typing import List, Sequence

import pytest

from gspo_megatron.config.schema import RolloutConfig
from gspo_megatron.rollout.types import (GenerationRequest, RolloutEngine, Sample, SamplingParams,
                                         WeightSyncStats, expand_requests, prefix_cache_hit,
                                         sample_seed)


def test_sampling_params_validation_names_the_field():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    p = SamplingParams(stop=["x"], stop_token_ids=[3])
    assert p.stop == ("x",) and p.stop_token_ids == (3,)
    assert hash(p) == hash(SamplingParams(stop=("x",), stop_token_ids=(3,)))


def test_sampling_params_from_config():
    cfg = RolloutConfig(temperature=0.7, top_p=0.9, max_new_tokens=12, stop=["</s>"])
    p = SamplingParams.from_config(cfg, seed=4)
    assert (p.temperature, p.top_p, p.max_new_tokens, p.stop, p.seed) == (0.7, 0.9, 12, ("</s>",), 4)


def test_sample_seed_is_stable_and_distinct():
    a = sample_seed(1, "p", 0)
    assert a == sample_seed(1, "p", 0)
    assert len({a, sample_seed(1, "p", 1), sample_seed(2, "p", 0), sample_seed(1, "q", 0)}) == 4
    assert sample_seed(None, "p", 0) is None
    assert 0 <= a < 2 ** 31


def test_expand_requests_and_duplicates():
    reqs = [GenerationRequest("a", [1, 2], n=2), GenerationRequest("b", [3], sample_index=5)]
    assert [(r.prompt_id, i) for r, i in expand_requests(reqs)] == [("a", 0), ("a", 1), ("b", 5)]
    with pytest.raises(ValueError, match="duplicate"):
        expand_requests([GenerationRequest("a", [1], n=2), GenerationRequest("a", [1], sample_index=1)])
    with pytest.raises(ValueError, match="empty"):
        GenerationRequest("a", [])


class _FakeEngine(RolloutEngine):
    def __init__(self, mangle=None):
        super().__init__()
        self.mangle = mangle

    def _generate(self, requests: Sequence[GenerationRequest], params) -> List[Sample]:
        out = [Sample(r.prompt_id, i, list(r.prompt_token_ids), [7] * (i + 1), [-1.0] * (i + 1),
                      "length", 0.0) for r, i in expand_requests(requests)]
        out.reverse()
        return self.mangle(out) if self.mangle else out

    def health(self):
        return True


def test_generate_sorts_and_counts():
    eng = _FakeEngine()
    out = eng.generate([GenerationRequest("b", [1], n=2), GenerationRequest("a", [1], n=1)],
                       SamplingParams())
    assert [s.key for s in out] == [("a", 0), ("b", 0), ("b", 1)]
    assert eng.metrics.num_generated_tokens == 1 + 1 + 2 and eng.metrics.num_samples == 3


def test_prefix_cache_hit_counts_only_samples_that_report_it():
    def sample(i, cache):
        return Sample(prompt_id="p", sample_index=i, prompt_token_ids=[1], response_token_ids=[2],
                      response_logprobs=[-1.0], finish_reason="length", latency_s=0.0,
                      prompt_cache=cache)
    assert prefix_cache_hit([sample(0, None)]) is None
    assert prefix_cache_hit([sample(0, (95, 96)), sample(1, (0, 32)), sample(2, None)]) == 95 / 128
    assert _FakeEngine().metrics.as_dict().get("rollout/prefix_cache_hit") is None  # not reported
    metrics = _FakeEngine().metrics
    metrics.prefix_cache_hit = 0.5
    assert metrics.as_dict()["rollout/prefix_cache_hit"] == 0.5


@pytest.mark.parametrize("mangle", [lambda s: s[1:], lambda s: s + s[:1]])
def test_generate_refuses_lost_or_duplicated_samples(mangle):
    with pytest.raises(RuntimeError, match="differ"):
        _FakeEngine(mangle).generate([GenerationRequest("a", [1], n=3)], SamplingParams())


def test_update_weights_without_transport_is_a_clear_error():
    with pytest.raises(RuntimeError, match="build_transport"):
        _FakeEngine().update_weights([])


def test_weight_sync_stats_rates():
    s = WeightSyncStats(num_bytes=2_000_000_000, seconds=0.5)
    assert s.gb_per_s == pytest.approx(4.0)
    assert s.as_metrics()["weight_sync/gb"] == pytest.approx(2.0)

"""Tests of the in-process weight transport (weight_sync/in_process.py)."""

import pytest
import torch

from gspo_megatron.rollout.embedded.engine import EmbeddedEngine, teacher_forced_logprobs
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams
from gspo_megatron.weight_sync.in_process import InProcessTransport


def test_bucketed_in_process_sync_is_bit_identical():
    torch.set_num_threads(1)
    fresh, tok = build_tiny_policy(seed=0)
    new, _ = build_tiny_policy(seed=7)
    eng = EmbeddedEngine(fresh, tok)
    eng.attach_weight_transport(InProcessTransport(eng, bucket_bytes=32 * 1024))
    stats = eng.update_weights(((n, t.clone()) for n, t in new.state_dict().items()), "v1")
    assert stats.num_buckets > 1 and stats.num_tensors == len(new.state_dict())
    assert stats.phases["weight_sync/transfer_s"] > 0 and eng.metrics.last_weight_sync is stats
    for name, t in new.state_dict().items():
        assert torch.equal(eng.model.state_dict()[name], t), name
    s = eng.generate([GenerationRequest("p", tok("3+4=")["input_ids"], n=2)],
                     SamplingParams(max_new_tokens=5, seed=1))
    for x in s:
        assert x.weight_version == "v1"
        ref = teacher_forced_logprobs(new, x.prompt_token_ids, x.response_token_ids)
        assert torch.allclose(torch.tensor(x.response_logprobs), ref, atol=1e-5)


def test_needs_an_engine_that_loads_weights():
    with pytest.raises(TypeError, match="cannot load weights"):
        InProcessTransport(object(), 10)

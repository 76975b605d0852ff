"""The embedded engine served by a child process: same samples as in-process, weights loaded
through shared memory, clear errors, and a clean shutdown."""

import pytest
import torch

from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.embedded.process import EmbeddedProcessEngine
from gspo_megatron.tiny_task.model import build_tiny_policy, save_tiny_model
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams
from gspo_megatron.weight_sync.in_process import InProcessTransport


def test_child_process_engine_matches_the_in_process_one(tmp_path):
    path = str(save_tiny_model(*build_tiny_policy(seed=0), tmp_path / "policy"))
    local = EmbeddedEngine.from_pretrained(path)
    remote = EmbeddedProcessEngine(path, num_threads=1)
    try:
        requests = [GenerationRequest(f"p{i}", [5 + i, 6, 7], n=3) for i in range(3)]
        params = SamplingParams(temperature=0.8, max_new_tokens=8, seed=4)

        def same():  # log-probs to float rounding: the two processes may use other thread counts
            a, b = remote.generate(requests, params), local.generate(requests, params)
            return all(x.response_token_ids == y.response_token_ids
                       and x.response_logprobs == pytest.approx(y.response_logprobs, abs=1e-5)
                       for x, y in zip(a, b))

        assert same()
        assert remote.metrics.num_samples == 9 and remote.metrics.num_generated_tokens > 0

        new = {k: v * 1.5 for k, v in local.model.state_dict().items() if "norm" not in k}
        # the trainer's path: the in-process transport's buckets -> load_weights (shared memory)
        remote.attach_weight_transport(InProcessTransport(remote, bucket_bytes=1 << 14))
        stats = remote.update_weights(new.items(), weight_version="7")
        local.load_weights(new.items())
        assert stats.num_tensors == len(new) and stats.num_bytes > 0 and stats.num_buckets > 1
        assert same()  # the child generates with the weights written into shared memory
        assert {s.weight_version for s in remote.generate(requests, params)} == {"7"}

        with pytest.raises(KeyError, match="not a parameter"):
            remote.load_weights([("nope.weight", torch.zeros(1))])
        with pytest.raises(ValueError, match="does not match"):
            remote.load_weights([("lm_head.weight", torch.zeros(3, 3))])
        assert remote.health()
    finally:
        remote.shutdown()
    assert not remote.health()
    remote.shutdown()  # idempotent


def test_a_bad_model_directory_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        EmbeddedProcessEngine(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    engine = EmbeddedProcessEngine(str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="embedded engine process failed"):
            engine.wait_ready()
    finally:
        engine.shutdown()

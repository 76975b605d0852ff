"""Broadcast-group weight sync to reference servers in other processes (disaggregated mode).

Two reference servers are started with the CLI (``python -m ...reference_server``); the test
process is group rank 0 and broadcasts bucketed weights over gloo, as the learner does.
"""

import socket

import pytest
import torch

from gspo_megatron.config.schema import SGLangConfig, WeightSyncConfig
from gspo_megatron.rollout.embedded import teacher_forced_logprobs
from gspo_megatron.rollout.factory import launch_reference_fleet
from gspo_megatron.rollout.sglang_engine import SGLangEngine
from gspo_megatron.tiny_task.model import build_tiny_policy, save_tiny_model
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams
from gspo_megatron.weight_sync import build_transport
from gspo_megatron.weight_sync.distributed_broadcast import BroadcastTransport


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_broadcast_sync_to_two_server_processes(tmp_path):
    torch.set_num_threads(1)
    save_tiny_model(*build_tiny_policy(seed=0), tmp_path / "m")
    ports = SGLangConfig(num_servers=2, port=_free_port())
    launcher = launch_reference_fleet(ports, str(tmp_path / "m"), log_dir=str(tmp_path / "logs"))
    eng = SGLangEngine(launcher.addresses, request_timeout_s=60, launcher=launcher)
    try:
        eng.wait_healthy(timeout_s=180)
        transport = build_transport(WeightSyncConfig(transport="nccl", bucket_bytes=48 * 1024), eng,
                                    mode="disaggregated", master_port=_free_port())
        assert isinstance(transport, BroadcastTransport) and transport.backend == "gloo"
        assert transport.world_size == 3
        for version, seed in (("v1", 5), ("v2", 6)):
            new, tok = build_tiny_policy(seed=seed)
            stats = eng.update_weights(((n, t.clone()) for n, t in new.state_dict().items()), version)
            assert stats.num_buckets > 1 and stats.num_tensors == len(new.state_dict())
            for client in eng.clients:  # bit-identical on every server
                for name in ("lm_head.weight", "model.layers.0.mlp.experts.3.up_proj.weight",
                             "model.layers.1.mlp.gate.weight"):
                    got = torch.tensor(client.get_weights_by_name(name, 10 ** 6), dtype=torch.float32)
                    assert torch.equal(got, new.state_dict()[name].reshape(-1)), (client.address, name)
            samples = eng.generate([GenerationRequest(f"p{i}", tok(t)["input_ids"], n=2)
                                    for i, t in enumerate(["1+2=", "hello"])],
                                   SamplingParams(max_new_tokens=6, seed=4, temperature=0.9))
            for s in samples:
                assert s.weight_version == version
                ref = teacher_forced_logprobs(new, s.prompt_token_ids, s.response_token_ids, 0.9)
                assert torch.allclose(torch.tensor(s.response_logprobs), ref, atol=1e-5)
    finally:
        eng.shutdown()
    assert launcher.servers == []

"""Tests of the shared-disk weight transport (weight_sync/disk.py)."""

import json
import os

import pytest
import torch

from gspo_megatron.rollout.embedded.engine import EmbeddedEngine, teacher_forced_logprobs
from gspo_megatron.rollout.standin.server import ReferenceServer
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams
from gspo_megatron.weight_sync.disk import DiskTransport


@pytest.fixture(scope="module")
def new_policy():
    torch.set_num_threads(1)
    return build_tiny_policy(seed=8)


def test_disk_transport_to_embedded_engine(tmp_path, new_policy):
    new, tok = new_policy
    eng = EmbeddedEngine(build_tiny_policy(seed=0)[0], tok)
    transport = DiskTransport(str(tmp_path / "sync"), bucket_bytes=64 * 1024, engine=eng)
    stats = transport.send(new.state_dict().items(), "d1")
    assert stats.num_buckets > 1 and stats.num_tensors == len(new.state_dict())
    for name, t in new.state_dict().items():
        assert torch.equal(eng.model.state_dict()[name], t), name
    first = os.listdir(tmp_path / "sync")
    assert len(first) == 1
    index = json.load(open(tmp_path / "sync" / first[0] / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(new.state_dict())
    transport.send(new.state_dict().items())
    assert len(os.listdir(tmp_path / "sync")) == 1 and os.listdir(tmp_path / "sync") != first


def test_disk_transport_to_reference_server(tmp_path, new_policy):
    new, tok = new_policy
    server = ReferenceServer(EmbeddedEngine(*build_tiny_policy(seed=0))).start()
    eng = SGLangEngine([server.address], request_timeout_s=60)
    try:
        eng.attach_weight_transport(DiskTransport(str(tmp_path), 64 * 1024, servers=True))
        stats = eng.update_weights(new.state_dict().items(), weight_version="disk-1")
        # the disk path needs no begin/end session (update_weights_from_disk post-processes itself)
        # (/server_info: the sender reads the server's model path to check names and shapes)
        calls = [p for _, p, _ in server.request_log if p != "/server_info"]
        assert calls == ["/pause_generation", "/update_weights_from_disk", "/flush_cache",
                         "/continue_generation"]
        assert stats.phases["weight_sync/num_servers"] == 1.0
        s = eng.generate([GenerationRequest("p", tok("7+1=")["input_ids"], n=2)],
                         SamplingParams(max_new_tokens=6, seed=3))
        for x in s:
            assert x.weight_version == "disk-1"
            ref = teacher_forced_logprobs(new, x.prompt_token_ids, x.response_token_ids)
            assert torch.allclose(torch.tensor(x.response_logprobs), ref, atol=1e-5)
    finally:
        eng.shutdown()
        server.stop()


def test_disk_transport_needs_a_directory_and_a_target():
    with pytest.raises(ValueError, match="disk_dir"):
        DiskTransport("", 10, engine=object())
    with pytest.raises(ValueError, match="servers=True"):
        DiskTransport("/tmp/x", 10)

"""Tests of the in-process and CUDA-IPC weight transports (weight_sync/in_process.py)."""

import base64
import pickle

import pytest
import torch

from gspo_megatron.rollout.embedded import EmbeddedEngine, teacher_forced_logprobs
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams
from gspo_megatron.weight_sync.in_process import CudaIpcTransport, InProcessTransport


def test_embedded_engine_uses_new_weights_after_in_process_sync():
    torch.set_num_threads(1)
    model, tok = build_tiny_policy(seed=0)
    new, _ = build_tiny_policy(seed=6)
    eng = EmbeddedEngine(model, tok)
    eng.attach_weight_transport(InProcessTransport(eng, bucket_bytes=32 * 1024))
    stats = eng.update_weights(((n, t.clone()) for n, t in new.state_dict().items()), "v1")
    assert stats.num_buckets > 1 and stats.num_tensors == len(new.state_dict())
    assert eng.metrics.last_weight_sync is stats and stats.seconds > 0
    for name, t in new.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    s = eng.generate([GenerationRequest("p", tok("1+1=")["input_ids"], n=2)],
                     SamplingParams(max_new_tokens=6, seed=1, temperature=0.8))
    for x in s:
        ref = teacher_forced_logprobs(new, x.prompt_token_ids, x.response_token_ids, 0.8)
        assert torch.allclose(torch.tensor(x.response_logprobs), ref, atol=1e-5)
        assert x.weight_version == "v1"


def test_in_process_transport_needs_a_loader():
    with pytest.raises(TypeError, match="in-process"):
        InProcessTransport(object(), 10)


class _RecordingClient:
    address = "fake:1"

    def __init__(self):
        self.bodies = []

    def update_weights_from_tensor(self, body):
        self.bodies.append(body)
        return "ok"


def test_cuda_ipc_transport_request_shape():
    """CPU check of the /update_weights_from_tensor bodies (the serializer is SGLang's on GPU)."""
    serialize = lambda obj: base64.b64encode(pickle.dumps([(n, t.shape) for n, t in obj])).decode()
    clients = [_RecordingClient(), _RecordingClient()]
    tensors = [(f"w{i}", torch.zeros(16)) for i in range(5)]  # 64 bytes each
    stats = CudaIpcTransport(clients, bucket_bytes=128, tp_size=2, serialize=serialize).send(
        iter(tensors), weight_version="v9")
    assert stats.num_buckets == 3 and stats.num_bytes == 5 * 64
    for c in clients:
        assert [b["flush_cache"] for b in c.bodies] == [False, False, True]
        assert [b.get("weight_version") for b in c.bodies] == [None, None, "v9"]
        for b in c.bodies:
            assert set(b) <= {"serialized_named_tensors", "load_format", "flush_cache", "weight_version"}
            assert len(b["serialized_named_tensors"]) == 2  # one per server TP rank
        names = [n for b in c.bodies for n, _ in pickle.loads(base64.b64decode(b["serialized_named_tensors"][0]))]
        assert names == [n for n, _ in tensors]

"""Tests of the tensor-handle transport (weight_sync/tensor_ipc.py) and the handles' unpickler."""

import base64
import io
import pickle

import pytest
import torch

from gspo_megatron.rollout.standin.handle_unpickler import load_named_tensors
from gspo_megatron.weight_sync.buckets import Bucket
from gspo_megatron.weight_sync.tensor_ipc import CudaIpcTransport, bucket_views, serialize_named_tensors


def test_views_share_one_buffer_and_handles_reopen_it():
    bucket = Bucket.from_items([("a", torch.randn(3, 4)), ("b", torch.randn(5)), ("c", torch.randn(2, 2))])
    flat, views = bucket_views(bucket)
    storages = {v.untyped_storage().data_ptr() for _, v in views}
    assert storages == {flat.untyped_storage().data_ptr()}  # one handle per bucket, not per tensor
    items = load_named_tensors(serialize_named_tensors(views))
    assert [n for n, _ in items] == ["a", "b", "c"]
    for (_, got), (_, want) in zip(items, bucket.items):
        assert torch.equal(got, want)
    flat.zero_()  # shared memory, not a copy
    assert all(float(t.abs().sum()) == 0.0 for _, t in items)


def test_the_unpickler_blocks_globals_outside_the_allow_list():
    evil = base64.b64encode(pickle.dumps([("x", print)])).decode()
    with pytest.raises(RuntimeError, match=r"Blocked unsafe global \(builtins.print\)"):
        load_named_tensors(evil)
    with pytest.raises(ValueError, match="base64"):
        load_named_tensors("not base64!")
    buf = io.BytesIO()
    pickle.dump({"x": 1}, buf)
    with pytest.raises(ValueError, match="pairs"):
        load_named_tensors(base64.b64encode(buf.getvalue()).decode())


class RecordingClient:
    def __init__(self):
        self.bodies = []

    def update_weights_from_tensor(self, body):
        self.bodies.append(body)


def test_one_blob_per_server_tp_rank_and_the_version_on_every_bucket():
    t = CudaIpcTransport(None, bucket_bytes=1 << 20, tp_size=4, serialize=lambda items: "blob")
    t._clients = [RecordingClient(), RecordingClient()]
    t.send_bucket(Bucket.from_items([("a", torch.ones(2))]), "v3")
    for c in t._clients:
        assert c.bodies == [{"serialized_named_tensors": ["blob"] * 4, "load_format": None,
                             "flush_cache": False, "weight_version": "v3"}]
    with pytest.raises(ValueError, match="TP size"):
        CudaIpcTransport(None, 10, tp_size=0)


def test_on_cpu_each_bucket_is_copied_at_most_once_into_shared_memory():
    """A bucket the gather received into shared memory goes by handle as it lies; another is
    packed into one shared staging buffer, reused bucket after bucket, released at the end."""
    from gspo_megatron.checkpoint.gather import ReusedBuffers
    from gspo_megatron.weight_sync.tensor_ipc import shared_buffer

    sent = []
    t = CudaIpcTransport(None, bucket_bytes=1 << 20, serialize=lambda items: sent.append(items) or "b")
    t._clients = [RecordingClient()]
    assert isinstance(t.gather_buffers(), ReusedBuffers)
    arena = shared_buffer("received", 64, "cpu")
    assert arena.is_shared()
    received = arena[:48].view(torch.float32)
    received.copy_(torch.arange(12.0))
    t.send_bucket(Bucket.from_items([("a", received[:4].view(2, 2)), ("b", received[4:])]))
    assert [v.data_ptr() for _, v in sent[-1]] == [arena.data_ptr(), arena.data_ptr() + 16]
    private = [Bucket.from_items([("c", torch.full((4,), float(i))), ("d", torch.ones(2))])
               for i in range(2)]
    staging = []
    for bucket in private:
        t.send_bucket(bucket)
        views = sent[-1]
        assert all(v.is_shared() for _, v in views)
        assert [torch.equal(v, w) for (_, v), (_, w) in zip(views, bucket.items)] == [True, True]
        staging.append(views[0][1].data_ptr())
    assert staging[0] == staging[1]  # the same staging memory for the second bucket
    items = load_named_tensors(serialize_named_tensors(sent[-1]))  # what a server opens
    assert torch.equal(items[0][1], torch.full((4,), 1.0))
    t.finish("v1")
    t.send_bucket(private[0])
    assert sent[-1][0][1].is_shared()  # a new update: staging allocated again

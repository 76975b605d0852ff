"""Tests of size-bounded bucketing of (hf_name, tensor) streams (weight_sync/buckets.py)."""

import pytest
import torch

from gspo_megatron.rollout.sglang import flat_bucket
from gspo_megatron.weight_sync.buckets import iter_buckets, tensor_bytes


def _stream(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (64,), (3, 3, 3), (100,), (1,), (33, 2), (10, 10), (2,)]
    out = [(f"w{i}", torch.randn(s, generator=g)) for i, s in enumerate(shapes)]
    out.insert(3, ("half", torch.randn(9, generator=g).to(torch.bfloat16)))
    return out


@pytest.mark.parametrize("limit", [40, 256, 500, 1000, 10 ** 6])
def test_no_bucket_exceeds_its_limit_and_order_is_kept(limit):
    stream = _stream()
    buckets = list(iter_buckets(iter(stream), limit))
    assert [n for b in buckets for n in b.names] == [n for n, _ in stream]
    for b in buckets:
        assert b.num_bytes == sum(tensor_bytes(t) for _, t in b.items)
        assert len({t.dtype for _, t in b.items}) == 1
        if b.num_bytes > limit:
            assert b.oversized and len(b.items) == 1
        else:
            assert not b.oversized
    if limit >= 10 ** 6:
        assert len(buckets) == 3  # fp32 | bf16 | fp32: split only by dtype


def test_streamed_tensors_arrive_bit_identical():
    stream = _stream(1)
    received = []
    for b in iter_buckets(iter(stream), 600):
        wire = b.flatten().clone()  # what a broadcast delivers
        received += flat_bucket.unflatten(wire, b.names, b.dtype_names, b.shapes)
    assert [n for n, _ in received] == [n for n, _ in stream]
    for (_, got), (_, want) in zip(received, stream):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_bad_limits_and_duplicate_names():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets([], 0))
    with pytest.raises(ValueError, match="'a' appears twice"):
        list(iter_buckets([("a", torch.zeros(1)), ("a", torch.zeros(1))], 100))
    assert list(iter_buckets([], 10)) == []


def test_a_bucket_already_back_to_back_goes_on_the_wire_without_a_copy():
    from gspo_megatron.weight_sync.buckets import Bucket

    whole = torch.arange(40, dtype=torch.bfloat16)  # a gathered bucket: HF tensors are its views
    run = [("a", whole[:12].view(3, 4)), ("b", whole[12:20]), ("c", whole[20:40].view(4, 5))]
    wire = Bucket.from_items(run).wire_bytes()
    assert wire.data_ptr() == whole.data_ptr() and wire.numel() == 80  # a view, every byte
    assert torch.equal(wire, Bucket.from_items(run).flatten())
    offset = Bucket.from_items(run[1:]).wire_bytes()  # starting inside the storage
    assert offset.data_ptr() == whole[12:].data_ptr() and offset.numel() == 56
    not_one_run = {
        "a gap": [run[0], run[2]],
        "out of order": [run[1], run[0]],
        "another storage": [run[0], ("d", torch.ones(8, dtype=torch.bfloat16))],
        "not contiguous": [("t", whole[:20].view(4, 5).t())],
    }
    for why, items in not_one_run.items():
        assert flat_bucket.contiguous_bytes([t for _, t in items]) is None, why
        wire = Bucket.from_items(items).wire_bytes()  # a copy, the same bytes
        assert torch.equal(wire, Bucket.from_items(items).flatten()), why
        assert not any(wire.data_ptr() == t.data_ptr() for _, t in items), why

"""Tests of SGLang's flattened_bucket layout (rollout/sglang/flat_bucket.py)."""

import pytest
import torch

from gspo_megatron.rollout.sglang import flat_bucket as fb


def test_roundtrip_is_bit_identical_for_each_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ts = [torch.randn(3, 4).to(dtype), torch.randn(5).to(dtype), torch.randn(2, 1, 2).to(dtype)]
        flat = fb.flatten(ts)
        assert flat.dtype == torch.uint8 and flat.numel() == sum(t.numel() * t.element_size() for t in ts)
        out = fb.unflatten(flat.clone(), ["a", "b", "c"], [fb.dtype_name(dtype)] * 3, [t.shape for t in ts])
        for (name, got), want in zip(out, ts):
            assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


def test_metadata_errors():
    flat = fb.flatten([torch.zeros(4)])
    with pytest.raises(ValueError, match="metadata describes"):
        fb.unflatten(flat, ["a"], ["float32"], [[2]])
    with pytest.raises(ValueError, match="overruns"):
        fb.unflatten(flat, ["a"], ["float32"], [[8]])
    with pytest.raises(ValueError, match="aligned"):
        fb.unflatten(torch.zeros(6, dtype=torch.uint8), ["a", "b"], ["uint8", "float32"], [[2], [1]])
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        fb.parse_dtype("float99")
    assert fb.empty_flat(["bfloat16", "float32"], [[3], [2]]).numel() == 3 * 2 + 2 * 4

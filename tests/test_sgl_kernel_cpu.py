"""Our CPU ``sgl_kernel`` (``sglang_cpu/sgl_kernel``) against plain references.

The package is pure torch and is imported here from its source folder (the test environment has
no SGLang); the real server's virtualenv installs the same file (``make sglang-venv``), and
``tests/test_rollout_sglang_real_server.py`` runs SGLang's CPU engine on it.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SOURCE = Path(__file__).resolve().parents[1] / "sglang_cpu" / "sgl_kernel" / "__init__.py"


@pytest.fixture(scope="module")
def kernel():
    spec = importlib.util.spec_from_file_location("gspo_test_sgl_kernel", SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gspo_test_sgl_kernel", None)


def _assign_reference(rows, table, starts, ends, slots):
    """SGLang's Triton kernel, one request at a time (srt/mem_cache/allocation.py)."""
    out = table.clone()
    offset = 0
    for row, start, end in zip(rows.tolist(), starts.tolist(), ends.tolist()):
        for j in range(end - start):
            out[row, start + j] = slots[offset + j]
        offset += end - start
    return out


def test_assign_req_to_token_pool_writes_each_requests_slots_into_its_row(kernel):
    torch.manual_seed(0)
    table = torch.zeros(6, 16, dtype=torch.int32)
    rows = torch.tensor([4, 0, 2], dtype=torch.int64)
    starts = torch.tensor([0, 5, 3], dtype=torch.int64)
    ends = torch.tensor([7, 5, 16], dtype=torch.int64)  # the middle request adds nothing
    slots = torch.randperm(100)[:7 + 0 + 13].to(torch.int64)
    expected = _assign_reference(rows, table, starts, ends, slots)
    kernel.assign_req_to_token_pool_cpu(rows, table, starts, ends, slots, 16)
    assert torch.equal(table, expected)
    assert table.dtype == torch.int32 and int(table[1].abs().sum()) == 0  # other rows untouched


def test_assign_req_to_token_pool_refuses_inconsistent_arguments(kernel):
    table = torch.zeros(2, 4, dtype=torch.int32)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="pool_len 5"):
        kernel.assign_req_to_token_pool_cpu(one, table, one * 0, one * 0 + 2, torch.arange(2), 5)
    with pytest.raises(ValueError, match="outside"):
        kernel.assign_req_to_token_pool_cpu(one, table, one * 0, one * 0 + 5, torch.arange(5), 4)
    with pytest.raises(ValueError, match="only 1 cache slots"):
        kernel.assign_req_to_token_pool_cpu(one, table, one * 0, one * 0 + 3, torch.arange(1), 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_all_layer_kv_cache_copies_rows_of_every_buffer(kernel, dtype):
    torch.manual_seed(1)
    buffers = [torch.randn(10, 3, 4).to(dtype), torch.randn(10, 5).to(dtype)]  # K and V shapes
    before = [b.clone() for b in buffers]
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers], dtype=torch.int64)
    # overlapping sets: row 3 is a source and a target; every source is read before writing
    src = torch.tensor([1, 3, 7], dtype=torch.int64)
    tgt = torch.tensor([3, 8, 2], dtype=torch.int64)
    kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for got, old in zip(buffers, before):
        expected = old.clone()
        expected[tgt] = old[src]
        assert torch.equal(got, expected)


def test_copy_all_layer_kv_cache_with_nothing_to_copy_touches_nothing(kernel):
    buf = torch.randn(4, 2)
    before = buf.clone()
    empty = torch.tensor([], dtype=torch.int64)
    kernel.copy_all_layer_kv_cache_cpu(torch.tensor([buf.data_ptr()], dtype=torch.uint64),
                                       torch.tensor([8]), empty, empty)
    assert torch.equal(buf, before)


def test_speculative_kernels_import_but_refuse_to_run(kernel):
    for name in kernel.SPECULATIVE_ONLY:
        fn = getattr(kernel, name)
        with pytest.raises(NotImplementedError, match=name):
            fn(torch.zeros(1))


def test_any_other_kernel_raises_naming_itself(kernel):
    with pytest.raises(AttributeError, match=r"sgl_kernel.silu_and_mul is not in gspo-megatron"):
        kernel.silu_and_mul  # noqa: B018
    assert not hasattr(kernel, "convert_weight_packed")  # SGLang's AMX probe stays false

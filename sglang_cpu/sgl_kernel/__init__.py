"""A CPU ``sgl_kernel`` for SGLang 0.5.23's CPU engine: only what its pure-torch path calls.

The registry's ``sglang-kernel`` wheel is CUDA-only (it fails to import without
``libcuda.so.1``) and no CPU build is published. With ``--device cpu`` SGLang's server imports
two functions from it unconditionally, both when ``is_cpu()``:
``srt/mem_cache/allocation.py`` takes ``assign_req_to_token_pool_cpu`` and
``kernels/ops/kvcache/cache_move.py`` takes ``copy_all_layer_kv_cache_cpu`` (the signatures are
the CUDA wheel's, ``sgl_kernel/speculative.py`` and ``sgl_kernel/kvcacheio.py``). Speculative
decoding's CPU kernels (``kernels/ops/speculative/``) are imported at start-up too, though only
speculative decoding calls them and we never enable it: they exist here as functions that raise
``NotImplementedError`` naming themselves when called. Everything else it
would take from ``sgl_kernel`` on CPU is behind ``cpu_has_amx_support()``
(``srt/utils/common.py``), which also asks for ``torch.ops.sgl_kernel.convert_weight_packed``;
this package registers no torch ops, so SGLang takes its pure-torch layers even on a CPU with
AMX.

Any other attribute raises an ``AttributeError`` naming itself and this file, so a new kernel
use in a future SGLang shows up loudly in the server's log instead of as a wrong answer.
(``from sgl_kernel import x`` turns it into an ``ImportError``, which is what SGLang's own
optional imports already expect when a kernel is absent.)

Installed into the real server's virtualenv by ``make sglang-venv``; unit-tested against plain
references in ``tests/test_sgl_kernel_cpu.py``.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.5.23.0+gspo.cpu"

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Write each request's new KV slots into its row of the request-to-token table, in place.

    Request ``i`` of the batch owns row ``req_pool_indices[i]`` of ``req_to_token``
    (``[num_rows, pool_len]``); its new tokens occupy positions
    ``[start_offset[i], end_offset[i])`` of that row, and their KV-cache slots are the next
    ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (the batch's slots, request
    after request). The same contract as SGLang's Triton kernel ``assign_req_to_token_pool``
    (``srt/mem_cache/allocation.py``) and the wheel's ``sgl_kernel/speculative.py`` signature.
    """
    if pool_len != req_to_token.shape[1]:
        raise ValueError(f"assign_req_to_token_pool_cpu: pool_len {pool_len} != "
                         f"req_to_token.shape[1] {req_to_token.shape[1]}")
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    if not len(rows) == len(starts) == len(ends):
        raise ValueError(f"assign_req_to_token_pool_cpu: {len(rows)} rows, {len(starts)} starts "
                         f"and {len(ends)} ends")
    lengths = [e - s for s, e in zip(starts, ends)]
    if any(n < 0 for n in lengths) or any(s < 0 or e > pool_len for s, e in zip(starts, ends)):
        raise ValueError(f"assign_req_to_token_pool_cpu: a range outside [0, {pool_len}): "
                         f"starts {starts}, ends {ends}")
    if sum(lengths) > out_cache_loc.numel():
        raise ValueError(f"assign_req_to_token_pool_cpu: {sum(lengths)} new tokens but only "
                         f"{out_cache_loc.numel()} cache slots")
    offset = 0
    for row, start, end, n in zip(rows, starts, ends, lengths):
        if n:
            req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def _host_rows(address: int, row_bytes: int, num_rows: int) -> torch.Tensor:
    """``num_rows`` rows of ``row_bytes`` bytes at host ``address``, as a writable uint8 view."""
    buffer = (ctypes.c_uint8 * (row_bytes * num_rows)).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(num_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """Copy KV-cache rows ``src_loc[j] -> tgt_loc[j]`` in every buffer, in place.

    ``data_ptrs[b]`` is the address of buffer ``b`` (one per layer and K/V: the pool's
    ``data_ptr()`` values) and ``strides[b]`` its row size in bytes. Every source row is read
    before any target row is written, so overlapping source and target sets copy as the Triton
    kernel ``copy_all_layer_kv_cache_tiled`` (``kernels/ops/kvcache/cache_move.py``) does:
    "safe for in-place copy".
    """
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"copy_all_layer_kv_cache_cpu: {tgt_loc.numel()} targets but "
                         f"{src_loc.numel()} sources")
    if data_ptrs.numel() != strides.numel():
        raise ValueError(f"copy_all_layer_kv_cache_cpu: {data_ptrs.numel()} buffers but "
                         f"{strides.numel()} strides")
    if src_loc.numel() == 0:
        return
    src = src_loc.to(torch.long)
    tgt = tgt_loc.to(torch.long)
    if int(torch.minimum(src.min(), tgt.min())) < 0:
        raise ValueError("copy_all_layer_kv_cache_cpu: a negative cache location")
    num_rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        rows = _host_rows(int(address), int(row_bytes), num_rows)
        rows[tgt] = rows[src]  # advanced indexing on the right copies first


SPECULATIVE_ONLY = ("build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",
                    "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
                    "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
                    "rotate_input_ids_cpu")
"""Imported at module level by ``kernels/ops/speculative/*.py`` on CPU; called only by
speculative decoding, which the rollout servers never enable."""


def _speculative_only(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: gspo-megatron's CPU sgl_kernel does not implement speculative "
            f"decoding's kernels (sglang_cpu/sgl_kernel/__init__.py); start the server without "
            f"--speculative-algorithm")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


for _name in SPECULATIVE_ONLY:
    globals()[_name] = _speculative_only(_name)
del _name


def __getattr__(name: str):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"sgl_kernel.{name} is not in gspo-megatron's CPU sgl_kernel (sglang_cpu/sgl_kernel/"
        f"__init__.py): SGLang's CPU engine asked for a kernel this build does not provide")

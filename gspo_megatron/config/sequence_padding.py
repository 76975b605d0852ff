"""The one rule for how far a packed micro-batch is padded: TP (sequence parallel), CP and FP8.

A micro-batch of ``T`` tokens (one packed THD row, or ``L`` tokens x ``R`` rows on the local spec)
is cut three ways before a GEMM sees it:

- context parallelism (``cp > 1``) splits every sequence into ``2 * cp`` load-balanced chunks, so
  ``T`` is a multiple of ``2 * cp`` and each CP rank holds ``T / cp`` tokens;
- sequence parallelism splits each CP rank's tokens over the ``tp`` ranks (Megatron's own rule is
  ``tp * cp * 2`` with CP: megatron/core/models/multimodal/context_parallel.py ``get_padding``);
- FP8 GEMMs in Transformer Engine (2.11, the version the image pins) assert on the token dimension:

  * ``assert_dim_for_fp8_exec`` (transformer_engine/pytorch/utils.py): the product of all input dims
    but the last divisible by 8, on the module's *local* input (``T / (cp * tp)`` rows for a
    column-parallel linear under SP, ``T / cp`` otherwise);
  * cuBLASLt FP8 needs the leading dimension divisible by 16 (common/gemm/cublaslt_gemm.cu, "Caller
    must pad."); in the weight-gradient GEMM that dimension is the token count of the CP shard;
  * MXFP8 quantizes 1x32 blocks in both directions (pytorch/csrc/quantizer.cpp
    ``MXFP8Quantizer::create_tensor``: "MXFP8 requires tensor dims that are divisible by 32");
  * with SP the column-parallel input is all-gathered already quantized, and
    ``assert_dim_for_all_gather`` asks ``quantizer.is_quantizable``: blocks of 128 for the blockwise
    recipe (pytorch/tensor/float8_blockwise_tensor.py, ``block_len = 128``), 32 for MXFP8.

Megatron-Core 0.16.1 pads to 16 (32 for MXFP8) when FP8 is on (megatron/core/fp8_utils.py
``get_fp8_align_size``, used by the MoE token dispatcher and the multimodal ``get_padding``), which
is the GEMM rule above; this module adds the local and all-gather rules, which bite under SP.
The padded length is the least common multiple of all of them. Experts pad their own token
groups (``TEGroupedMLP`` with ``Fp8Padding``), so only the dense path needs this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")


@dataclass(frozen=True)
class FP8RowRule:
    """Token-dimension divisibility Transformer Engine asserts for one FP8 recipe."""

    gemm_rows: int
    """Tokens of one CP shard (the weight-gradient GEMM's leading dimension)."""
    local_rows: int
    """Tokens of a module's local input (``assert_dim_for_fp8_exec`` or the quantizer's blocks)."""
    gathered_rows: int
    """Tokens of a local input that is all-gathered in FP8 under SP (``is_quantizable``)."""


FP8_ROW_RULES: Dict[str, FP8RowRule] = {
    "delayed": FP8RowRule(gemm_rows=16, local_rows=8, gathered_rows=8),
    "tensorwise": FP8RowRule(gemm_rows=16, local_rows=8, gathered_rows=8),
    "mxfp8": FP8RowRule(gemm_rows=32, local_rows=32, gathered_rows=32),
    "blockwise": FP8RowRule(gemm_rows=16, local_rows=8, gathered_rows=128),
}


def sequence_pad_multiple(tp: int = 1, sp: bool = False, cp: int = 1,
                          fp8_recipe: Optional[str] = None) -> int:
    """Smallest ``M`` such that every packed length that is a multiple of ``M`` is accepted.

    ``fp8_recipe`` is None when FP8 is off. Without FP8 this is ``tp`` (with SP) times ``2 * cp``
    (with CP), as before; FP8 raises it to what Transformer Engine asserts (module docstring).
    """
    if tp < 1 or cp < 1:
        raise ValueError(f"tp={tp} and cp={cp} must be >= 1")
    sp_size = tp if sp else 1
    chunks = 2 * cp if cp > 1 else 1
    multiple = sp_size * chunks
    if fp8_recipe is None:
        return multiple
    if fp8_recipe not in FP8_ROW_RULES:
        raise ValueError(f"FP8 recipe '{fp8_recipe}' is not one of {', '.join(FP8_RECIPES)}")
    rule = FP8_ROW_RULES[fp8_recipe]
    # Column-parallel inputs under SP are T / (cp * tp) rows; row-parallel inputs are T / cp.
    local = rule.gathered_rows if sp and tp > 1 else rule.local_rows
    for need in (cp * rule.gemm_rows, cp * rule.local_rows, cp * sp_size * local):
        multiple = math.lcm(multiple, need)
    return multiple


def pad_multiple_for(parallel, model) -> int:
    """:func:`sequence_pad_multiple` of a ``ParallelConfig`` and a ``ModelConfig``."""
    recipe = model.fp8.recipe if model.fp8.enabled else None
    return sequence_pad_multiple(parallel.tp, parallel.sp, parallel.cp, recipe)


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple

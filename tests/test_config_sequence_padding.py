"""The one pad-multiple rule (config/sequence_padding.py) against a literal replay of the shape
checks Transformer Engine 2.11 and Megatron make, for every TP / SP / CP / FP8-recipe combination.

``te_accepts`` below follows the tensors, not the formula: it cuts a packed micro-batch of ``T``
tokens the way CP and SP do and applies each assertion to the tensor it is made on.
"""

from __future__ import annotations

import itertools

import pytest

from gspo_megatron.config import ConfigError, load_config
from gspo_megatron.config.sequence_padding import FP8_RECIPES, round_up, sequence_pad_multiple

# Per recipe: (divisor of quantized local inputs, block of an FP8 all-gathered input, GEMM leading dim).
TE_RULES = {"delayed": (8, 1, 16), "tensorwise": (8, 1, 16), "mxfp8": (32, 32, 32), "blockwise": (8, 128, 16)}


def te_accepts(tokens: int, tp: int, sp: bool, cp: int, recipe) -> bool:
    if cp > 1 and tokens % (2 * cp):
        return False  # 2*cp load-balanced chunks per sequence
    if tokens % cp:
        return False
    shard = tokens // cp  # one CP rank
    if sp and (shard % tp or (cp > 1 and (tokens // (2 * cp)) % tp)):
        return False  # SP scatters each CP rank's tokens (each chunk, Megatron: tp*cp*2) over TP
    if recipe is None:
        return True
    local_div, gather_block, gemm_ld = TE_RULES[recipe]
    column_in = shard // tp if sp else shard  # QKV / fc1 input (scattered under SP)
    row_in = shard  # proj / fc2 input
    for rows in (column_in, row_in):
        if rows % local_div:  # assert_dim_for_fp8_exec / MXFP8Quantizer::create_tensor
            return False
    if sp and tp > 1 and column_in % gather_block:  # assert_dim_for_all_gather -> is_quantizable
        return False
    return shard % gemm_ld == 0  # cuBLASLt FP8: leading dim of the wgrad GEMM (tokens) % 16


COMBOS = [(tp, sp, cp, recipe)
          for tp, cp, recipe in itertools.product((1, 2, 4, 8), (1, 2, 3, 4), (None,) + FP8_RECIPES)
          for sp in ((False, True) if tp > 1 else (False,))]


@pytest.mark.parametrize("tp, sp, cp, recipe", COMBOS)
def test_pad_multiple_is_the_smallest_length_te_accepts_and_all_its_multiples_pass(tp, sp, cp, recipe):
    multiple = sequence_pad_multiple(tp, sp, cp, recipe)
    smallest = next(t for t in range(1, multiple + 1) if te_accepts(t, tp, sp, cp, recipe))
    assert smallest == multiple
    assert all(te_accepts(k * multiple, tp, sp, cp, recipe) for k in range(1, 6))
    assert not any(te_accepts(k * multiple + 1, tp, sp, cp, recipe) for k in range(1, 4) if multiple > 1)


@pytest.mark.parametrize("tp, sp, cp, recipe, expected", [
    (2, True, 1, None, 2),            # before FP8: TP (SP) only
    (2, True, 2, None, 8),            # and 2*cp*tp with CP (Megatron's get_padding)
    (1, False, 1, "tensorwise", 16),  # Megatron's get_fp8_align_size
    (1, False, 1, "mxfp8", 32),
    (2, True, 1, "tensorwise", 16),   # the production layout (configs/qwen3_30b_a3b_gspo.yaml)
    (4, True, 1, "tensorwise", 32),   # 8 rows per SP shard
    (2, True, 1, "mxfp8", 64),
    (2, True, 1, "blockwise", 256),   # 128-row blocks of the all-gathered input per SP shard
    (2, True, 2, "tensorwise", 32),
])
def test_known_layouts(tp, sp, cp, recipe, expected):
    assert sequence_pad_multiple(tp, sp, cp, recipe) == expected


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="FP8 recipe 'fp4'"):
        sequence_pad_multiple(1, False, 1, "fp4")
    with pytest.raises(ValueError, match="must be >= 1"):
        sequence_pad_multiple(0)
    assert round_up(17, 16) == 32 and round_up(32, 16) == 32


TE_FP8 = ["model.transformer_impl=transformer_engine", "model.fp8.enabled=true",
          "model.fp8.recipe=blockwise", "model.num_experts=4", "parallel.world_size=8"]


def test_validation_pads_the_longest_sequence_as_the_learner_does():
    # 120 + 8 = 128 tokens fit 130 unpadded, but blockwise FP8 with TP2+SP pads to 256.
    sizes = ["data.max_prompt_tokens=120", "rollout.max_new_tokens=8"]
    layout = ["parallel.tp=2", "parallel.sp=true"]
    with pytest.raises(ConfigError, match=r"padded to a multiple of 256 .*\(256 tokens"):
        load_config(None, TE_FP8 + layout + sizes + ["batch.max_tokens_per_micro_batch=130"])
    load_config(None, TE_FP8 + layout + sizes + ["batch.max_tokens_per_micro_batch=256"])


def test_fp8_without_the_transformer_engine_spec_is_refused():
    base = ["model.fp8.enabled=true", "model.fp8.recipe=tensorwise", "model.num_experts=4"]
    for impl in ("auto", "local"):
        with pytest.raises(ConfigError, match=f"FP8 needs model.transformer_impl=transformer_engine.*got '{impl}'"):
            load_config(None, base + [f"model.transformer_impl={impl}"])
    load_config(None, base + ["model.transformer_impl=transformer_engine"])

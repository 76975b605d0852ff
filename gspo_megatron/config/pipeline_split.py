"""How many transformer layers each pipeline stage holds, as Megatron-Core 0.16.1 builds them.

A layout rule, so it lives with the config (validation refuses what Megatron cannot build); the
planner, the model builder and the checkpoint tools use the same function.

Megatron splits ``num_layers`` evenly over the PP stages unless
``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` are set; then
the first (last) stage gets exactly that many and the remaining layers are split evenly over the
middle stages (``megatron/core/transformer/transformer_block.py: get_num_layers_to_build`` and
``transformer_layer.py: get_transformer_layer_offset``; the checks are those of
``TransformerConfig.__post_init__``). Models whose layer count PP does not divide (Qwen3-235B-A22B:
94 layers) need the uneven form.

This module is pure Python (no torch, no Megatron) so that config validation and the planner can
use it; ``tests/test_config_pipeline_split.py`` checks it against Megatron's own functions.

    >>> stage_layer_counts(94, 8, first=11, last=11)
    [11, 12, 12, 12, 12, 12, 12, 11]
    >>> suggest_uneven_split(94, 4)
    (23, 23)
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from gspo_megatron.config.errors import ConfigError


class PipelineSplitError(ConfigError):
    """A layer count / pipeline layout that Megatron-Core cannot build."""


def stage_layer_counts(num_layers: int, pp: int, first: Optional[int] = None,
                       last: Optional[int] = None, vpp: Optional[int] = None) -> List[int]:
    """Transformer layers on each pipeline stage, first to last.

    Raises :class:`PipelineSplitError` (message without the config key; callers add it) for
    every split Megatron-Core would refuse or assert on.
    """
    if pp < 1 or num_layers < 1:
        raise PipelineSplitError(f"need pp >= 1 and num_layers >= 1, got pp={pp}, "
                                 f"num_layers={num_layers}")
    if pp == 1:
        if first is not None or last is not None:
            raise PipelineSplitError("first/last pipeline-stage layer counts need pp > 1")
        return [num_layers]
    if first is None and last is None:
        if num_layers % pp:
            raise PipelineSplitError(f"pp={pp} does not divide num_layers={num_layers}")
        counts = [num_layers // pp] * pp
    else:
        counts = _uneven(num_layers, pp, first, last)
    if vpp is not None:
        bad = [c for c in counts if c % vpp]
        if bad:
            raise PipelineSplitError(f"vpp={vpp} must divide the layers of every stage "
                                     f"{counts}")
    return counts


def _uneven(num_layers: int, pp: int, first: Optional[int], last: Optional[int]) -> List[int]:
    for name, value in (("first", first), ("last", last)):
        if value is not None and value <= 0:
            raise PipelineSplitError(f"layers in the {name} pipeline stage must be > 0, "
                                     f"got {value}")
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
        raise PipelineSplitError(
            f"{middle_layers} layers are left for {middle_stages} middle stages "
            f"(num_layers={num_layers}, first={first}, last={last}, pp={pp})")
    if middle_stages and middle_layers % middle_stages:
        raise PipelineSplitError(
            f"the {middle_layers} middle layers do not divide over {middle_stages} middle "
            f"stages (num_layers={num_layers}, first={first}, last={last}, pp={pp})")
    per_middle = middle_layers // middle_stages if middle_stages else 0
    counts = [per_middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def suggest_uneven_split(num_layers: int, pp: int) -> Optional[Tuple[int, int]]:
    """``(first, last)`` for a layer count PP does not divide, or None when it divides.

    The first stage also holds the embedding and the last the output layer and the log-prob
    pass, so they get at most as many layers as a middle stage; middle stages get
    ``ceil(num_layers / pp)`` (or fewer, until first and last are both >= 1).
    """
    if pp <= 1 or num_layers % pp == 0:
        return None
    for per_middle in range(-(-num_layers // pp), 0, -1):
        rest = num_layers - (pp - 2) * per_middle
        first, last = rest // 2, rest - rest // 2
        if first >= 1 and last >= 1 and max(first, last) <= max(per_middle, 1) + 1:
            return first, last
    raise PipelineSplitError(f"cannot split {num_layers} layers over pp={pp} stages")

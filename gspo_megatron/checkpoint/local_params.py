"""Walk one Megatron model chunk and name each local parameter slice canonically.

Every parameter of a chunk becomes one or more :class:`LocalUnit`: the canonical global name
(see :mod:`gspo_megatron.checkpoint.mapping`), a tensor *view* into the parameter that holds this
rank's slice of that canonical tensor (so conversion can ``copy_`` into it and export can read it),
and the shard spec plus this rank's position in the group the tensor is split over. Legacy
``GroupedMLP`` ``weight1``/``weight2`` (several experts in one parameter, stored transposed) are
expanded into one unit per local expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List

import torch

from gspo_megatron.checkpoint import mapping
from gspo_megatron.config.schema import ModelConfig


@dataclass
class LocalUnit:
    """This rank's slice of one canonical parameter."""

    name: str
    """Canonical global name."""
    tensor: torch.Tensor
    """View into the live parameter, shape = the local slice of the full canonical tensor."""
    spec: mapping.ShardSpec
    tp_rank: int
    """Rank within the group this tensor is split over (TP or expert-TP)."""
    tp_size: int


@dataclass(frozen=True)
class _Groups:
    tp_rank: int
    tp_size: int
    etp_rank: int
    etp_size: int
    expert_offset: int


def _groups(cfg: ModelConfig) -> _Groups:
    from megatron.core import parallel_state as ps

    ep_size = ps.get_expert_model_parallel_world_size() if cfg.num_experts else 1
    ep_rank = ps.get_expert_model_parallel_rank() if cfg.num_experts else 0
    etp_size = ps.get_expert_tensor_parallel_world_size() if cfg.num_experts else 1
    etp_rank = ps.get_expert_tensor_parallel_rank() if cfg.num_experts else 0
    return _Groups(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                   etp_rank, etp_size, ep_rank * (cfg.num_experts // max(ep_size, 1)))


def _legacy_grouped_units(local_name: str, param: torch.Tensor, fc: str, layer: int,
                          cfg: ModelConfig, g: _Groups) -> List[LocalUnit]:
    """GroupedMLP keeps weight1 as [h, E*2f] (= per expert fc1.T) and weight2 as [E*f, h]."""
    num_local = _local_expert_count(param, fc, cfg, g)
    h = cfg.hidden_size
    per_expert = (param.view(num_local, h, -1) if fc == "linear_fc1"
                  else param.view(num_local, -1, h))
    spec = mapping.shard_spec(mapping.expert_name(layer, 0, fc))
    return [LocalUnit(mapping.expert_name(layer, g.expert_offset + e, fc), per_expert[e].t(),
                      spec, g.etp_rank, g.etp_size) for e in range(num_local)]


def _local_expert_count(param: torch.Tensor, fc: str, cfg: ModelConfig, g: _Groups) -> int:
    width = cfg.moe_ffn_hidden_size // g.etp_size * (2 if fc == "linear_fc1" else 1)
    return param.numel() // (width * cfg.hidden_size)


def iter_local_units(chunk: torch.nn.Module, cfg: ModelConfig) -> Iterator[LocalUnit]:
    """Every local parameter slice of one model chunk, canonically named. Needs parallel state."""
    g = _groups(cfg)
    layers = chunk.decoder.layers

    def layer_offset(i: int) -> int:
        return layers[i].layer_number - 1  # Megatron's layer_number is global and 1-based

    for local_name, param in chunk.named_parameters():
        fc = mapping.legacy_grouped_fc(local_name)
        if fc is not None:
            layer = layer_offset(int(local_name.split(".")[2]))
            yield from _legacy_grouped_units(local_name, param.data, fc, layer, cfg, g)
            continue
        name = mapping.canonical_name(local_name, layer_offset, g.expert_offset)
        spec = mapping.shard_spec(name)
        rank, size = (g.etp_rank, g.etp_size) if spec.expert else (g.tp_rank, g.tp_size)
        if spec.dim is None:
            rank, size = 0, 1
        yield LocalUnit(name, param.data, spec, rank, size)

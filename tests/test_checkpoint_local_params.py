"""Legacy ``GroupedMLP`` parameters (all local experts in one transposed tensor) expand into one
canonically named view per expert, with the global expert index, and writes go through to the
parameter (no Megatron process needed)."""

from __future__ import annotations

import torch

from gspo_megatron.checkpoint.local_params import _Groups, _legacy_grouped_units
from gspo_megatron.config.schema import ModelConfig

CFG = ModelConfig(arch="qwen3_moe", hidden_size=4, num_experts=4, moe_ffn_hidden_size=3)


def test_legacy_grouped_weights_expand_per_expert():
    g = _Groups(tp_rank=0, tp_size=1, etp_rank=0, etp_size=1, expert_offset=2)
    fc1 = [torch.randn(6, 4) for _ in range(2)]  # [2f, h] per expert, as in SequentialMLP
    weight1 = torch.stack([w.t() for w in fc1]).reshape(4, -1)  # the view(E, h, 2f) layout
    units = _legacy_grouped_units("decoder.layers.0.mlp.experts.weight1", weight1, "linear_fc1",
                                  5, CFG, g)
    assert [u.name for u in units] == [
        "decoder.layers.5.mlp.experts.local_experts.2.linear_fc1.weight",
        "decoder.layers.5.mlp.experts.local_experts.3.linear_fc1.weight"]
    for u, w in zip(units, fc1):
        assert torch.equal(u.tensor, w) and u.spec.glu and u.spec.expert
    units[1].tensor.copy_(torch.zeros(6, 4))
    assert torch.equal(weight1.view(2, 4, 6)[1], torch.zeros(4, 6))

    fc2 = [torch.randn(4, 3) for _ in range(2)]  # [h, f]
    weight2 = torch.stack([w.t() for w in fc2]).reshape(-1, 4)  # GroupedMLP: [E*f, h]
    units = _legacy_grouped_units("decoder.layers.0.mlp.experts.weight2", weight2, "linear_fc2",
                                  5, CFG, g)
    assert len(units) == 2 and all(torch.equal(u.tensor, w) for u, w in zip(units, fc2))
    assert units[0].spec.dim == 1

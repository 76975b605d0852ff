"""The CPU peak-memory probe used to validate the planner: exact bytes for known allocations,
views counted once, autograd's saved tensors and gradients included, freed storages dropped."""

from __future__ import annotations

import torch

from benchmarks.live_tensor_bytes import LiveTensorBytes


def test_peak_and_live_bytes_of_known_allocations():
    with LiveTensorBytes() as probe:
        a = torch.zeros(1000)                       # 4,000 B
        view = a.view(10, 100)                      # same storage: not counted again
        c = torch.ones(500, dtype=torch.float64)    # 4,000 B, freed below
        del c
        d = torch.empty(250)                        # 1,000 B
        x = torch.randn(100, 100, requires_grad=True)   # 40,000 B
        y = (x * 2).sin().sum()  # x*2 kept for sin's backward; sin's output dies after sum
        forward_peak = probe.peak_bytes
        y.backward()             # cos(x*2) and grad * cos alive together with x*2
    assert forward_peak == 125004  # a, d, x, x*2, sin(x*2) and the scalar sum
    assert probe.peak_bytes == 165008  # + cos(x*2), grad * cos and the output gradient scalar
    assert probe.live_bytes == 4000 + 1000 + 40000 + 40000 + 4  # a, d, x, x.grad, y
    assert view.untyped_storage().nbytes() == 4000


def test_reset_peak_starts_from_what_is_alive():
    with LiveTensorBytes() as probe:
        keep = torch.zeros(100)
        tmp = torch.zeros(1000)
        del tmp
        probe.reset_peak()
        assert probe.peak_bytes == 400
        torch.zeros(50)
    assert probe.peak_bytes == 600 and keep.numel() == 100

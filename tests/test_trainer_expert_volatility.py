"""The expert-volatility probe's sampling and its inert cases (the MoE measurement itself is
tested through the learner in test_learner_routing.py and in the loop in test_trainer_loop.py)."""

from __future__ import annotations

from types import SimpleNamespace

from gspo_megatron.config.schema import GSPOConfig
from gspo_megatron.trainer.expert_volatility import ExpertVolatilityProbe, evenly_spaced


def test_evenly_spaced_sample():
    assert evenly_spaced(10, 4) == [0, 2, 5, 7]
    assert evenly_spaced(3, 8) == [0, 1, 2]


class _NoCalls:
    def __init__(self, routers):
        self.routers, self.dp_size = routers, 1

    def record_routing(self, batch):  # pragma: no cover - must not be reached
        raise AssertionError("an inert probe must not run a forward pass")


def test_probe_is_inert_when_off_or_dense():
    cfg = GSPOConfig()
    assert ExpertVolatilityProbe.start(_NoCalls([[]]), SimpleNamespace(), cfg).finish() == {}
    cfg.algo.diagnostics.expert_volatility_num_seqs = 0
    assert ExpertVolatilityProbe.start(_NoCalls([[object()]]), SimpleNamespace(), cfg).finish() == {}

"""The cold start's loss target: a windowed mean, never before the window is full, off by default."""

from __future__ import annotations

import math

from gspo_megatron.config import ConfigError, load_config
from gspo_megatron.trainer.sft_stop import SftStopRule

import pytest


def test_stops_once_the_windowed_mean_is_below_the_target():
    rule = SftStopRule(0.5, window=3)
    assert [rule.update(x) for x in (0.1, 0.2)] == [False, False]  # window not full yet
    assert rule.update(1.5) is False                               # mean 0.6
    assert rule.update(0.1) is False                               # (0.2, 1.5, 0.1): 0.6
    assert rule.update(0.1) is False                               # (1.5, 0.1, 0.1): 0.567
    assert rule.update(0.2) is True                                # (0.1, 0.1, 0.2): 0.133
    assert rule.mean_loss == pytest.approx(0.4 / 3)


def test_no_target_never_stops_and_bad_targets_are_refused():
    rule = SftStopRule(None, window=2)
    assert not any(rule.update(0.0) for _ in range(5))
    assert math.isnan(SftStopRule(None).mean_loss)
    with pytest.raises(ConfigError, match="trainer.sft_stop_loss: -1.0 must be > 0"):
        load_config(None, ["trainer.sft_stop_loss=-1.0"])

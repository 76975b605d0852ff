"""RewardRunner: parallel batches, per-call timeouts, failures become reward 0 and are counted."""

from __future__ import annotations

import threading
import time

import pytest

from gspo_megatron.config.schema import RewardConfig
from gspo_megatron.rewards import RewardRequest, RewardRunner


def _requests(responses, answer="1"):
    return [RewardRequest(f"p{i}", r, answer) for i, r in enumerate(responses)]


_RELEASE_HUNG = threading.Event()


def _misbehaving(response, answer, metadata=None):
    if response == "raise":
        raise RuntimeError("verifier crashed")
    if response == "hang":
        _RELEASE_HUNG.wait(30.0)
    if response == "nan":
        return float("nan")
    if response == "str":
        return "high"
    return 1.0 if response == answer else 0.0


def test_from_config_uses_registered_reward():
    runner = RewardRunner.from_config(RewardConfig(name="exact_match", timeout_s=5, num_workers=2))
    result = runner.compute(_requests([r"\boxed{1}", "2", "1"]))
    assert result.rewards == [1.0, 0.0, 1.0]
    assert result.stats.num_items == 3 and result.stats.num_errors == 0
    assert result.stats.mean_time_s >= 0.0


def test_errors_and_timeouts_give_zero_and_are_counted(caplog):
    # timeout generous enough for a loaded CI machine, far below the 30 s hang
    runner = RewardRunner(_misbehaving, timeout_s=1.0, num_workers=2, name="misbehaving")
    start = time.monotonic()
    try:
        result = runner.compute(_requests(["1", "raise", "hang", "nan", "str", "1", "0"]))
    finally:
        _RELEASE_HUNG.set()  # let the abandoned thread finish
    elapsed = time.monotonic() - start
    assert result.rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert result.stats.num_errors == 3 and result.stats.num_timeouts == 1
    assert elapsed < 10.0, "a hung reward must not hold the batch beyond its timeout"
    assert "raised for prompt p1" in caplog.text and "timed out after 1.0s for prompt p2" in caplog.text


def test_calls_run_in_parallel():
    def slow(response, answer, metadata=None):
        time.sleep(0.2)
        return 1.0

    start = time.monotonic()
    result = RewardRunner(slow, timeout_s=5, num_workers=4).compute(_requests(["x"] * 8))
    assert result.rewards == [1.0] * 8
    assert time.monotonic() - start < 1.5  # 8 x 0.2 s serial would be 1.6 s
    assert result.stats.mean_time_s == pytest.approx(0.2, abs=0.15)


def test_metadata_is_passed_and_bad_settings_rejected():
    def uses_metadata(response, answer, metadata=None):
        return float(metadata["weight"])

    req = [RewardRequest("p0", "r", "a", {"weight": 0.25})]
    assert RewardRunner(uses_metadata, num_workers=1).compute(req).rewards == [0.25]
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner(uses_metadata, timeout_s=0)
    with pytest.raises(ValueError, match="num_workers"):
        RewardRunner(uses_metadata, num_workers=0)


def test_a_hung_call_hands_its_worker_slot_on():
    """One worker: after the hung first call is abandoned, a fresh worker runs the rest."""
    release = threading.Event()

    def first_hangs(response, answer, metadata=None):
        if response == "hang":
            release.wait(30.0)
        return 1.0

    try:
        result = RewardRunner(first_hangs, timeout_s=0.5, num_workers=1).compute(
            _requests(["hang", "a", "b", "c"]))
    finally:
        release.set()
    assert result.rewards == [0.0, 1.0, 1.0, 1.0]
    assert result.stats.num_timeouts == 1 and result.stats.num_errors == 0

"""Reward registry: registered names, module:function, unknown names."""

from __future__ import annotations

import pytest

from gspo_megatron.rewards import RewardLookupError, get_reward_fn, register_reward, registered_rewards
from gspo_megatron.rewards import registry


def test_builtins_are_registered():
    assert {"math_verify", "exact_match", "format", "tiny_addition"} <= set(registered_rewards())


def test_register_and_lookup_and_conflict(monkeypatch):
    # the registry is the process's: this test's name must not outlive it (the reliability
    # table's reward list named it when this module ran before that test)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register_reward("test_const_half")
    def half(response, answer, metadata=None):
        return 0.5

    assert get_reward_fn("test_const_half") is half
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_const_half")(lambda r, a, m=None: 1.0)


def test_unknown_name_lists_registered_rewards():
    with pytest.raises(RewardLookupError) as err:
        get_reward_fn("no_such_reward")
    assert "unknown reward 'no_such_reward'" in str(err.value)
    assert "exact_match" in str(err.value) and "math_verify" in str(err.value)


def test_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        "def length_reward(response, answer, metadata=None):\n"
        "    return min(1.0, len(response) / 10)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_fn("my_rewards_mod:length_reward")
    assert fn("abcde", "", None) == 0.5
    with pytest.raises(RewardLookupError, match="has no callable 'missing'"):
        get_reward_fn("my_rewards_mod:missing")
    with pytest.raises(RewardLookupError, match="cannot import module 'not_a_module_xyz'"):
        get_reward_fn("not_a_module_xyz:f")


def test_a_registration_ends_with_its_test():
    """The registry has no name a test added (run after the test above, in any order)."""
    assert "test_const_half" not in registered_rewards()


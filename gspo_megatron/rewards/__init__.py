"""Reward functions (registered by name or given as ``module:function``) and a parallel runner."""

from gspo_megatron.rewards import builtin, chat  # noqa: F401  (register the built-in rewards)
from gspo_megatron.rewards.registry import (
    RewardFn,
    RewardLookupError,
    get_reward_fn,
    register_reward,
    registered_rewards,
)
from gspo_megatron.rewards.runner import RewardRequest, RewardResult, RewardRunner, RewardStats

__all__ = ["RewardFn", "RewardLookupError", "RewardRequest", "RewardResult", "RewardRunner",
           "RewardStats", "get_reward_fn", "register_reward", "registered_rewards"]

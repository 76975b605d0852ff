"""A reward for tests whose steps must take long: ``reward.name=tests.paced_reward:tiny_addition``.

It scores as the built-in ``tiny_addition`` after sleeping ``GSPO_TEST_REWARD_SLEEP_S`` seconds
(default 0: the same run as with the built-in), and appends a line to the file
``GSPO_TEST_REWARD_MARKS`` names (when set) as each call begins, so that a test can send a
signal while a step's rollout is being scored. Only the clock differs: rewards and everything
trained stay the built-in's.
"""

from __future__ import annotations

import os
import time

from gspo_megatron.rewards.builtin import addition_reward


def tiny_addition(response, answer, metadata=None) -> float:
    marks = os.environ.get("GSPO_TEST_REWARD_MARKS")
    if marks:
        with open(marks, "a") as f:
            f.write(f"{time.time()}\n")
    time.sleep(float(os.environ.get("GSPO_TEST_REWARD_SLEEP_S", "0")))
    return addition_reward(response, answer, metadata)

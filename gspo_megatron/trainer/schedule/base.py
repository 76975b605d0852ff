"""What every rollout schedule hands the loop, and the calls the loop makes on it.

The loop (``trainer/loop.py``) reads the same in every mode; the schedule decides when the
engine generates, under which weights, and when the weights are synced around the update:

    if not schedule.has(step): sync_weights(); schedule.submit(step, trained_steps)
    ready = schedule.take(step)             # collective: the batch and pi_old, prepared
    schedule.after_take(step, trained)      # one step: sync, and the next rollout starts
    train(ready)
    schedule.after_update(step)             # on-policy and k-stale: sync the new weights

``on_policy.py`` (k = 0), ``one_step.py`` (k = 1) and ``k_stale.py`` (k >= 2) implement it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist

from gspo_megatron.trainer.schedule.collect import ScoredRollout

SyncWeights = Callable[[], Dict[str, float]]
"""The loop's collective weight sync (a no-op when the engine already serves the learner's
weights); returns its metrics."""


@dataclass
class ReadyRollout:
    """A rollout every rank holds, prepared for training (batch and pi_old)."""

    rollout: ScoredRollout
    prepared: Any
    """What the loop's ``prepare`` returned for it (``trainer.loop.PreparedStep``)."""
    policy_lag: int
    """RL steps the learner has taken since the generating weights (0 on-policy, 1 overlapped,
    up to k for the oldest token of a k-stale batch)."""
    wait_s: float = 0.0
    """Seconds ``take`` blocked for the rollout (0 when it was already there)."""
    prepare_s: float = 0.0
    """Seconds of ``prepare`` (the learner's old-policy pass, when it runs one)."""


def broadcast_from_main(obj, world_size: int):
    """The main rank's ``obj`` on every rank (the rollout engine lives on the main rank)."""
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class RolloutSchedule(ABC):
    """The loop's interface to the three modes; see the module docstring."""

    max_staleness: int
    """The k this schedule runs (``rollout.max_staleness``)."""

    @abstractmethod
    def has(self, step: int) -> bool:
        """Whether ``step``'s rollout is already under way (no submission needed)."""

    @abstractmethod
    def submit(self, step: int, trained_steps: int) -> None:
        """Start ``step``'s rollout with the weights the engine now serves (the learner's
        after ``trained_steps`` RL steps)."""

    @abstractmethod
    def start(self, step: int) -> None:
        """Main rank: generate the submitted ``step`` in the background from now on, so the
        caller can do collective work meanwhile (finish a background save)."""

    @abstractmethod
    def take(self, step: int) -> ReadyRollout:
        """Collective: ``step``'s rollout on every rank, prepared."""

    def after_take(self, step: int, trained_steps: int) -> Dict[str, float]:
        """Between taking ``step``'s rollout and training on it; the sync's metrics."""
        return {}

    @abstractmethod
    def after_update(self, step: int) -> Dict[str, float]:
        """After ``step``'s updates; the sync's metrics (if this mode syncs here)."""

    @abstractmethod
    def wait_idle(self) -> None:
        """Until the engine has no generation of this schedule in flight (where it can)."""

    @abstractmethod
    def retire_saturated(self, group_rewards) -> List[str]:
        """Every rank: retire the prompts ``data.retire_solved_prompts`` names."""

    @abstractmethod
    def checkpoint_state(self) -> Optional[dict]:
        """Collective: what a checkpoint keeps of the rollouts in flight (plain values)."""

    @abstractmethod
    def abandon_state(self):
        """``(pending state, sampler state or None)`` for a checkpoint of the state before the
        open step, which a deadline cut."""

    @abstractmethod
    def restore(self, state: Optional[dict]) -> None:
        """Put back what :meth:`checkpoint_state` saved."""

    @abstractmethod
    def close(self) -> None:
        """End generation at the run's end or after an error (nothing raised over it)."""

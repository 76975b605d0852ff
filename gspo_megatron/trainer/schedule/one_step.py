"""k = 1 (``rollout.max_staleness=1``, alias ``rollout.overlap_one_step``): step k+1's rollout is
generated while step k trains, by the weights before step k.

    take(step)                         # submitted during the previous step (first step: now)
    after_take(step): sync_weights(); submit(step + 1)   # generation starts in the background
    train(step)                        # meanwhile; after_update syncs nothing

The weights go to the engine once per step, right after a rollout is taken, so the next one is
exactly one update old. With ``algo.old_logprob_source=learner`` pi_old is recomputed under the
generating weights (a ``WeightSnapshot`` kept from submission to use). Whether the overlap pays
on a machine's cores, and the thread split that makes it pay: ``one_step_threads.py``.
"""

from __future__ import annotations

from typing import Dict

from gspo_megatron.trainer.schedule.stepwise import RolloutPipeline


class OneStepRollouts(RolloutPipeline):
    """Generate one step ahead, sync when a rollout is taken."""

    overlap = True

    def after_take(self, step: int, trained_steps: int) -> Dict[str, float]:
        """Sync the learner's weights (``trained_steps`` RL steps) and submit ``step + 1``,
        unless ``step`` is the run's last."""
        if self.last_step is not None and step >= self.last_step:
            return {}
        metrics = self.sync_weights()
        self.submit(step + 1, trained_steps=trained_steps)
        return metrics

    def after_update(self, step: int) -> Dict[str, float]:
        """Nothing: the next rollout already has the weights it is one step behind."""
        return {}

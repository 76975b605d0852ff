"""The loop's saves, held to the job's deadline: a step's checkpoint (in the foreground, or
written in the background), what a finished save reports, and the two places a warned run may
give up a step (``trainer/deadline.py`` decides, ``trainer/preemption.py`` acts on signals).

Every method is collective: all ranks call it in the same order, and the main rank's rule
decides for all of them (one ``all_reduce`` of a flag), so no rank enters a save or leaves a
step alone.

    saves = StepSaves(parts)
    saves.abandon_if_late(step)              # after the rollout, before the update: may raise
    saves.save(step, extra, background=True)  # periodic; finished before the next update
    row.update(saves.done())                 # the finished saves' numbers, the progress note
    saves.save_abandoned(step, reason, rollouts)   # a dropped step: the state after ``step``
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist

from gspo_megatron.trainer.deadline import ABANDON, BETWEEN, GENERATING, GIVE_UP, SAVING
from gspo_megatron.trainer.preemption import (NO_CHECKPOINT_EXIT_CODE, REQUEUE_EXIT_CODE,
                                              StepAbandoned)

log = logging.getLogger(__name__)


def any_rank(flag: bool, world_size: int) -> bool:
    """Collective: ``flag`` on some rank (gloo or NCCL; one element)."""
    if world_size == 1:
        return flag
    on_gpu = dist.get_backend() == "nccl"  # NCCL reduces device tensors only
    t = torch.tensor([1 if flag else 0],
                     device=torch.cuda.current_device() if on_gpu else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class StepSaves:
    """See the module docstring; ``parts`` is the run's ``trainer.build.TrainerParts``."""

    def __init__(self, parts) -> None:
        self.p = parts

    def _any(self, flag: bool) -> bool:
        return any_rank(flag, self.p.runtime.world_size)

    def save(self, step: int, extra: Dict, sampler_state: Optional[dict] = None,
             background: bool = False) -> Path:
        """Checkpoint ``step`` (``background``: its files are written while the next rollout
        is generated, and it counts once finished, before the next update)."""
        p = self.p
        p.preemption.enter(SAVING)
        path = p.checkpoints.save(step, extra=extra, sampler_state=sampler_state,
                                  background=background)
        p.preemption.enter(BETWEEN)
        return path

    def done(self) -> Dict[str, float]:
        """The saves finished since the last call: their times feed the deadline rule, the
        progress note names the newest, and the newest's numbers are returned for the row."""
        p, metrics = self.p, {}
        for step, report in p.checkpoints.reports:
            p.preemption.times.observe("save", report.total_s)
            if p.runtime.is_main:
                p.preemption.progress(p.run_dir, p.preemption.trained_step or step,
                                      checkpoint=Path(report.directory), checkpoint_step=step)
            metrics = {"checkpoint/step": float(step),
                       "time/checkpoint_blocking_s": report.blocking_s,
                       "time/checkpoint_s": report.total_s,
                       "checkpoint/written_gb": report.bytes_written / 1e9,
                       "checkpoint/size_gb": report.checkpoint_bytes / 1e9,
                       "checkpoint/peak_host_gb": report.peak_rss_bytes / 2**30}
        p.checkpoints.reports.clear()
        return metrics

    def abandon_if_late(self, step: int) -> None:
        """At the last point before the learner changes (the rollout of ``step + 1`` is in): a
        warned run whose deadline leaves no room for the update and a save drops it here."""
        p, late = self.p, False
        if p.runtime.is_main:
            decision = p.preemption.decision(GENERATING, elapsed_s=float("inf"))
            late = decision is not None and decision.action in (ABANDON, GIVE_UP)
            if late:
                log.warning("abandoning step %d before its update: %s", step + 1,
                            decision.reason)
        if self._any(late):
            raise StepAbandoned(f"no room for step {step + 1}'s update and a save")

    def no_time_to_save(self) -> bool:
        """The deadline leaves no room for a save (the main rank's rule, logged there)."""
        p, short = self.p, False
        if p.runtime.is_main:
            decision = p.preemption.decision(BETWEEN)
            short = decision is not None and decision.action == GIVE_UP
            if short:
                log.error("%s: stopping without a checkpoint; %s (exit %d)", decision.reason,
                          p.preemption.redo_note(), NO_CHECKPOINT_EXIT_CODE)
        return self._any(short)

    def save_abandoned(self, step: int, reason: StepAbandoned, rollouts) -> int:
        """Step ``step + 1`` was dropped before the learner changed: stop the servers' work on
        its rollout, checkpoint the state after ``step`` (``rollouts.abandon_state``: what is
        pending and the data position before the dropped step), exit for the requeue."""
        p = self.p
        if p.engine is not None:  # main rank
            p.engine.cancel_generation()
        pending, sampler_state = rollouts.abandon_state()
        if self.no_time_to_save():
            return NO_CHECKPOINT_EXIT_CODE
        self.save(step, {"pending_rollout": pending}, sampler_state=sampler_state)
        self.done()
        log.warning("dropped step %d (%s) and checkpointed the state after step %d; exiting %d "
                    "for requeue", step + 1, reason, step, REQUEUE_EXIT_CODE)
        return REQUEUE_EXIT_CODE

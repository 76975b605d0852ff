"""When a warned run can still checkpoint: the job's deadline against measured step and save times.

Slurm warns a job before it ends: ``--signal=B:USR1@600`` ten minutes before the time limit, and
SIGTERM when it is preempted with a ``GraceTime``, whose end time Slurm then moves to now +
GraceTime (``src/interfaces/preempt.c``, ``_job_check_grace_internal``: ``end_time =
MIN(end_time, preempt_time + grace_time)``, then SIGCONT and SIGTERM to the job). The batch
shell (``slurm/lib.sh``) reads that end time (``squeue -o %e``) and writes, into the file named by
``GSPO_DEADLINE_FILE``, the time by which the learner must have exited so that the shell can
still stop the servers and requeue the job (``exit_by=<unix seconds>``).

A step of the production run takes minutes and its checkpoint more than one, so whether "finish
this step, then save" fits before ``exit_by`` depends on where in the step the warning lands.
:func:`decide` answers from the times this run measured (:class:`StepTimes`):

- ``continue``: finish the step, then save (what the warning asks for); check again at
  ``recheck_at``, the last moment the plan still holds;
- ``abandon``: the step cannot finish and be saved in time, but the learner has not changed
  yet (the rollout is still being generated, or its update has not begun): drop the step and
  save the state after the last completed one now;
- ``give_up``: not even a save fits before ``exit_by`` (or a save under way will not end by
  then): exit without a checkpoint; the resumed run starts from the last complete one and redoes
  the steps since.

Everything here is pure (no clock, no signals) so that the rule is tested on its own; the signal
side is ``trainer/preemption.py``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Deque, Dict, Iterable, Optional

GENERATING = "generating"
"""The step's rollout is being produced or waited for; the learner holds the last step's state."""
UPDATING = "updating"
"""Optimizer steps (and the weight sync after them): the learner's state is mid-step."""
SAVING = "saving"
"""A checkpoint is being written."""
BETWEEN = "between"
"""Start-up, evaluation, logging: no step is open."""
PHASES = (GENERATING, UPDATING, SAVING, BETWEEN)

CONTINUE, ABANDON, GIVE_UP = "continue", "abandon", "give_up"

SAFETY = 1.25
"""Measured durations are planned with this factor (steps vary: response lengths, stragglers)."""
WINDOW = 5
"""Estimates are the longest of the last this many observations."""


@dataclass
class StepTimes:
    """The durations a run measured, per kind: ``generate`` (a step's rollout wait), ``update``
    (the rest of the step: pi_old pass, optimizer steps, weight sync) and ``save`` (a whole
    checkpoint). ``save_prior_s``: the save estimate before one was measured (the planner's)."""

    save_prior_s: float = 0.0
    _seen: Dict[str, Deque[float]] = field(default_factory=dict, repr=False)

    def observe(self, kind: str, seconds: float) -> None:
        if kind not in ("generate", "update", "save"):
            raise ValueError(f"unknown duration kind {kind!r}")
        if math.isfinite(seconds) and seconds >= 0:
            self._seen.setdefault(kind, deque(maxlen=WINDOW)).append(float(seconds))

    def estimate(self, kind: str) -> Optional[float]:
        """The longest recent ``kind`` times :data:`SAFETY`; None before any was measured
        (``save``: the prior instead)."""
        seen = self._seen.get(kind)
        if seen:
            return max(seen) * SAFETY
        return self.save_prior_s * SAFETY if kind == "save" else None


@dataclass(frozen=True)
class Decision:
    action: str
    """:data:`CONTINUE`, :data:`ABANDON` or :data:`GIVE_UP`."""
    reason: str
    recheck_at: Optional[float] = None
    """Unix time at which the decision may change (None: it will not before the next phase)."""


def decide(now: float, exit_by: float, phase: str, phase_elapsed_s: float,
           times: StepTimes) -> Decision:
    """What a warned run does at ``now`` (unix seconds) in ``phase``, entered
    ``phase_elapsed_s`` ago, to be out by ``exit_by``. See the module docstring."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    left = exit_by - now
    save = times.estimate("save") or 0.0
    if phase == SAVING:
        if left <= 0:
            return Decision(GIVE_UP, "the deadline passed during the save")
        return Decision(CONTINUE, f"saving; {left:.0f}s left", recheck_at=exit_by)
    if left <= save:
        return Decision(GIVE_UP, f"{left:.0f}s left before the deadline, a save takes ~{save:.0f}s")
    if phase in (UPDATING, BETWEEN):
        return Decision(CONTINUE, f"{left:.0f}s left; a save takes ~{save:.0f}s",
                        recheck_at=exit_by - save)
    update = times.estimate("update")
    if update is None:
        return Decision(ABANDON, "no step has been measured yet, so this one cannot be shown "
                                 f"to fit the {left:.0f}s left")
    generate = times.estimate("generate")
    remaining = max(generate - phase_elapsed_s, 0.0) if generate is not None else 0.0
    latest = exit_by - update - save  # the rollout must be in by then
    if now + remaining > latest:
        return Decision(ABANDON, f"{left:.0f}s left; the rest of this step (~{remaining:.0f}s of "
                                 f"rollout, ~{update:.0f}s of update) and a save (~{save:.0f}s) "
                                 "do not fit")
    return Decision(CONTINUE, f"{left:.0f}s left: the step (~{remaining + update:.0f}s more) and a "
                              f"save (~{save:.0f}s) fit", recheck_at=latest)


def save_prior_s(parameters: Iterable, world_size: int, write_gbps: float) -> float:
    """A save's time before the run measured one, an upper bound: this rank's ``parameters``
    with fp32 main weights and Adam moments (12 bytes per trained parameter) times
    ``world_size``, over one node's write bandwidth (``plan.checkpoint_write_gbps``, GB/s)."""
    local = sum(p.numel() * (p.element_size() + (12 if p.requires_grad else 0))
                for p in parameters)
    return local * world_size / (write_gbps * 1e9)


class DeadlineFileError(ValueError):
    """The deadline file exists but does not say ``exit_by=<unix seconds>``."""


def read_exit_by(path: Optional[str]) -> Optional[float]:
    """``exit_by`` from the batch shell's deadline file; None when there is no file (no Slurm,
    a job without a time limit, or the shell could not read the end time)."""
    if not path:
        return None
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    try:
        return float(values["exit_by"])
    except (KeyError, ValueError):
        raise DeadlineFileError(f"{path}: expected a line exit_by=<unix seconds>, got "
                                f"{text[:200]!r}") from None


__all__ = ["ABANDON", "BETWEEN", "CONTINUE", "Decision", "DeadlineFileError", "GENERATING",
           "GIVE_UP", "SAVING", "StepTimes", "UPDATING", "decide", "read_exit_by", "save_prior_s"]

"""Slurm's warning signals turned into "checkpoint after this step", held to the job's deadline.

Slurm sends ``--signal=B:USR1@<seconds>`` before the time limit and SIGTERM at a preemption with
``GraceTime``; ``slurm/lib.sh`` passes the signal on to every learner rank and writes the time
by which the learner must have exited into ``GSPO_DEADLINE_FILE`` (``trainer/deadline.py``). The
first signal sets :attr:`PreemptionFlag.requested`; the loop then finishes the step it is in,
saves a checkpoint and exits with :data:`REQUEUE_EXIT_CODE`, which the shell answers with
``scontrol requeue``. A repeated signal (the shell repeats it for ranks that had not installed
their handler yet) changes nothing: no count of signals ever turns "checkpoint" into "stop".

Time does. On the main rank every signal, and a timer armed for the moment the plan stops
holding, runs the deadline rule (:func:`trainer.deadline.decide`) on the times this run measured:

- the step and the save fit: carry on;
- they do not, and the learner still holds the last completed step (its rollout is being
  generated): :class:`StepAbandoned` is raised in the wait (only the waits the loop marks with
  :meth:`PreemptionFlag.abandonable`), every rank drops the step, and the state after the last
  completed step is saved at once (``trainer/loop.py``);
- not even a save fits before the deadline: the process exits :data:`NO_CHECKPOINT_EXIT_CODE`
  at once (``SystemExit``, so ``finally`` blocks stop launched servers and release the run
  directory), and the log names the checkpoint the resumed run starts from.

Without a deadline file (no Slurm, a job without a time limit) the rule has nothing to plan
with and the step is finished and saved, as asked.

``gspo-train`` creates its :class:`PreemptionFlag` first thing (before torch or Megatron is
imported), because SIGUSR1's default action ends the process (exit 138) with no checkpoint and
no requeue. A signal that arrives while the job is still starting is answered at the next
start-up stage (:meth:`PreemptionFlag.exit_code_if_requested`): there is nothing new to save
yet, so the job exits 124 at once and is requeued.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from gspo_megatron.trainer.deadline import (ABANDON, BETWEEN, CONTINUE, GIVE_UP, PHASES,
                                            DeadlineFileError, Decision, StepTimes, decide,
                                            read_exit_by)

log = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 124
"""The learner checkpointed (or had nothing new to save): requeue, resume from the newest."""
NO_CHECKPOINT_EXIT_CODE = 125
"""The learner stopped before the deadline without a checkpoint of its newest steps: requeue,
and the resumed run redoes the steps since the last complete checkpoint."""
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
RECHECK_SIGNAL = signal.SIGALRM
"""The main rank's own timer (``setitimer``): the deadline rule is run again when it fires."""
DEADLINE_FILE_ENV = "GSPO_DEADLINE_FILE"
PROGRESS_FILE = "progress.env"
"""In the run directory: ``trained_step``, ``checkpoint_step`` and ``checkpoint`` (the shell's
requeue message reads them)."""


class StepAbandoned(BaseException):
    """The open step cannot finish and be saved before the deadline: drop it, save the state
    after the last completed step. A BaseException, so that no ``except Exception`` of a
    rollout client on the way swallows it."""


@dataclass
class AbandonMarker:
    """What the main rank broadcasts instead of a rollout when it abandoned the step."""

    reason: str


def raise_if_abandoned(received) -> None:
    """Every rank: raise :class:`StepAbandoned` when the main rank sent an :class:`AbandonMarker`."""
    if isinstance(received, AbandonMarker):
        raise StepAbandoned(received.reason)


class PreemptionFlag:
    """One per process: the signal handlers, the deadline rule's inputs and its actions."""

    def __init__(self, signals=PREEMPTION_SIGNALS) -> None:
        self.requested = False
        self.signal_name = ""
        self.times = StepTimes()
        """Measured by the loop; the rule plans with them."""
        self.acting = False
        """True on the main rank once the run is built: only it runs the rule and acts."""
        self.deadline_file = os.environ.get(DEADLINE_FILE_ENV) or None
        self.trained_step: Optional[int] = None
        self.checkpoint_step: Optional[int] = None
        self.last_decision: Optional[Decision] = None
        self._checkpoint_path = ""
        self._logged_action = ""
        self._phase, self._phase_t0 = BETWEEN, time.monotonic()
        self._abandonable = False
        self._previous = {}
        for sig in (*signals, RECHECK_SIGNAL):
            self._previous[sig] = signal.signal(sig, self._handle)

    def close(self) -> None:
        """Disarm the timer and put the previous handlers back (an in-process run ends)."""
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    # ---- signals -------------------------------------------------------------------------
    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if signum != RECHECK_SIGNAL:
            if self.requested:
                log.warning("received %s again: the checkpoint asked for by %s stands",
                            name, self.signal_name)
            else:
                self.requested = True
                self.signal_name = name
                log.warning("received %s: will checkpoint after the current step and exit %d",
                            name, REQUEUE_EXIT_CODE)
        self.act()

    def exit_by(self) -> Optional[float]:
        """The deadline (unix seconds) the batch shell wrote; None without one."""
        try:
            return read_exit_by(self.deadline_file)
        except (DeadlineFileError, OSError) as exc:
            log.error("%s; finishing the step and saving as if there were no deadline", exc)
            return None

    def decision(self, phase: Optional[str] = None,
                 elapsed_s: Optional[float] = None) -> Optional[Decision]:
        """The rule's answer now for ``phase`` (default: the current one, entered
        ``elapsed_s`` ago, default: as measured); None when nothing was asked for or there is
        no deadline."""
        if not self.requested:
            return None
        exit_by = self.exit_by()
        if exit_by is None:
            return None
        phase = phase or self._phase
        if elapsed_s is None:
            elapsed_s = time.monotonic() - self._phase_t0
        self.last_decision = decide(time.time(), exit_by, phase, elapsed_s, self.times)
        return self.last_decision

    def act(self) -> None:
        """Main rank: run the rule and do what it says (see the module docstring)."""
        if not self.acting:
            return
        decision = self.decision()
        if decision is None:
            return
        if decision.action == CONTINUE and self._logged_action != CONTINUE:
            log.warning("the deadline leaves room (%s): %s", self._phase, decision.reason)
        self._logged_action = decision.action
        if decision.action == GIVE_UP:
            self.give_up(decision.reason)
        if decision.action == ABANDON and self._abandonable:
            self._abandonable = False
            log.warning("abandoning the open step: %s; saving the state after step %s now",
                        decision.reason, self.trained_step)
            raise StepAbandoned(decision.reason)
        if decision.recheck_at is not None:
            signal.setitimer(signal.ITIMER_REAL, max(decision.recheck_at - time.time(), 0.05))

    def give_up(self, reason: str) -> None:
        """Exit :data:`NO_CHECKPOINT_EXIT_CODE` now, naming what the resumed run redoes."""
        signal.setitimer(signal.ITIMER_REAL, 0)
        log.error("%s: stopping without a checkpoint; %s (exit %d)", reason, self.redo_note(),
                  NO_CHECKPOINT_EXIT_CODE)
        raise SystemExit(NO_CHECKPOINT_EXIT_CODE)

    def redo_note(self) -> str:
        """Which checkpoint the resumed run starts from, and how many steps it redoes."""
        done = self.trained_step or 0
        if self.checkpoint_step is None:
            return f"no checkpoint of this run yet: a resumed run redoes its {done} step(s)"
        return (f"a resumed run starts from the checkpoint of step {self.checkpoint_step} and "
                f"redoes {done - self.checkpoint_step} step(s)")

    # ---- the loop's marks ----------------------------------------------------------------
    def enter(self, phase: str) -> None:
        """The loop moved to ``phase`` (``trainer.deadline``); a warned run checks at once."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        self._phase, self._phase_t0 = phase, time.monotonic()
        self.act()

    @contextmanager
    def abandonable(self) -> Iterator[None]:
        """A wait (main rank) that :class:`StepAbandoned` may interrupt: the learner still
        holds the last completed step while it lasts."""
        self._abandonable = True
        try:
            self.act()
            yield
        finally:
            self._abandonable = False

    def progress(self, run_dir: Path, trained_step: int, checkpoint: Optional[Path] = None,
                 checkpoint_step: Optional[int] = None) -> None:
        """Main rank: record the trained step (and a new checkpoint, of ``checkpoint_step``,
        default the trained one) in ``run_dir``'s :data:`PROGRESS_FILE`, which the batch shell
        quotes when it requeues."""
        self.trained_step = trained_step
        if checkpoint is not None:
            self.checkpoint_step = trained_step if checkpoint_step is None else checkpoint_step
            self._checkpoint_path = str(checkpoint)
        lines = [f"trained_step={trained_step}"]
        if self.checkpoint_step is not None:
            lines += [f"checkpoint_step={self.checkpoint_step}",
                      f"checkpoint={self._checkpoint_path}"]
        path = Path(run_dir) / PROGRESS_FILE
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text("\n".join(lines) + "\n")
            os.replace(tmp, path)
        except OSError as exc:  # a note for the shell's message; never worth failing a run
            log.warning("cannot write %s: %s", path, exc)

    def exit_code_if_requested(self, stage: str) -> Optional[int]:
        """:data:`REQUEUE_EXIT_CODE` (logged) if a signal came in; call between start-up stages."""
        if not self.requested:
            return None
        log.warning("%s arrived during start-up (%s): nothing new to checkpoint; exiting %d so "
                    "that the job is requeued", self.signal_name, stage, REQUEUE_EXIT_CODE)
        return REQUEUE_EXIT_CODE

"""Turn Slurm's warning signal into "checkpoint at the end of this step, then exit 124".

Slurm sends ``--signal=B:USR1@<seconds>`` before the time limit (and SIGTERM on preemption).
The handler only sets a flag; the loop finishes the step it is in, saves a checkpoint and exits
with :data:`REQUEUE_EXIT_CODE`, which ``slurm/lib.sh`` answers with ``scontrol requeue``.

``gspo-train`` creates its :class:`PreemptionFlag` first thing (before torch or Megatron is
imported), because SIGUSR1's default action ends the process (exit 138) with no checkpoint and
no requeue. A signal that arrives while the job is still starting is answered at the next
start-up stage (:meth:`PreemptionFlag.exit_code_if_requested`): there is nothing new to save
yet, so the job exits 124 at once and is requeued. A second signal does not wait for the end
of the step: it ends the process at once (exit 124), wherever it is blocked.
"""

from __future__ import annotations

import logging
import signal
from typing import Optional

log = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 124
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionFlag:
    def __init__(self, signals=PREEMPTION_SIGNALS) -> None:
        self.requested = False
        self.signal_name = ""
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.requested:
            # A second signal: whoever sent it will not wait for the step to end (a sync or a
            # start-up call blocked on a server). Unwind now: ``finally`` blocks stop launched
            # servers and release the run directory; the last complete checkpoint stays.
            name = signal.Signals(signum).name
            log.error("received %s again: stopping now, without a checkpoint of this step; a "
                      "resumed run starts from the last complete checkpoint (exit %d)",
                      name, REQUEUE_EXIT_CODE)
            raise SystemExit(REQUEUE_EXIT_CODE)
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        log.warning("received %s: will checkpoint after the current step and exit %d",
                    self.signal_name, REQUEUE_EXIT_CODE)

    def exit_code_if_requested(self, stage: str) -> Optional[int]:
        """:data:`REQUEUE_EXIT_CODE` (logged) if a signal came in; call between start-up stages."""
        if not self.requested:
            return None
        log.warning("%s arrived during start-up (%s): nothing new to checkpoint; exiting %d so "
                    "that the job is requeued", self.signal_name, stage, REQUEUE_EXIT_CODE)
        return REQUEUE_EXIT_CODE

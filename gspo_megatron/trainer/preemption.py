"""Turn Slurm's warning signal into "checkpoint at the end of this step, then exit 124".

Slurm sends ``--signal=B:USR1@<seconds>`` before the time limit (and SIGTERM on preemption).
The handler only sets a flag; the loop finishes the step it is in, saves a checkpoint and exits
with :data:`REQUEUE_EXIT_CODE`, which ``slurm/lib.sh`` answers with ``scontrol requeue``.
"""

from __future__ import annotations

import logging
import signal

log = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 124


class PreemptionFlag:
    def __init__(self, signals=(signal.SIGUSR1, signal.SIGTERM)) -> None:
        self.requested = False
        self.signal_name = ""
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        log.warning("received %s: will checkpoint after the current step and exit %d",
                    self.signal_name, REQUEUE_EXIT_CODE)

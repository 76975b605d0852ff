"""Tell the Slurm job's supervisor when this trainer holds its servers paused.

slurm/fleet.sh probes every server's ``/health_generate`` and restarts one that has not answered
200 for ``rollout.sglang.hang_timeout_s``. SGLang answers that probe by generating one token
(``srt/entrypoints/http_server.py``, health_generate), which waits behind a
``/pause_generation``; so while a weight sync or a memory release of ours holds the fleet paused,
a healthy server looks hung. The job exports ``GSPO_FLEET_PAUSE_FILE``; the file exists exactly
while generation is paused by us, and the supervisor's hang clock stands still meanwhile.
Outside a Slurm job (the variable unset) this does nothing.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

PAUSE_FILE_ENV = "GSPO_FLEET_PAUSE_FILE"


def mark_fleet_paused(paused: bool) -> None:
    """Create (``paused``) or remove the supervisor's pause file; a failure is logged, never
    raised (it may only cost a false hang report, never the sync)."""
    path = os.environ.get(PAUSE_FILE_ENV)
    if not path:
        return
    try:
        if paused:
            with open(path, "w") as f:
                f.write(f"{os.getpid()}\n")
        elif os.path.exists(path):
            os.remove(path)
    except OSError as exc:
        log.warning("%s=%s: cannot %s it (%s); the job's hang check may count this pause",
                    PAUSE_FILE_ENV, path, "write" if paused else "remove", exc)

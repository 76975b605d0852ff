"""Test hook: a process SIGKILLs itself at a named point of a run (``GSPO_TEST_KILL_AT``).

Never set in production. A kill at a random moment (``kill -9`` after a sleep) lands wherever
the process happens to be; a test of what a resumed run recovers needs the kill to land at a
known place, with the server in a known state. With

    GSPO_TEST_KILL_AT=<point>:<step> gspo-train CONFIG ...

the process sends itself SIGKILL (no cleanup, no ``finally``, no atexit: what the OOM killer or a
node agent does) the first time it reaches ``<point>`` while the loop is in RL step ``<step>``
(1-based, :func:`enter_step`; 0 before the first RL step: cold start and first evaluation).
Before dying it writes one line to stderr naming the point and what was in flight
(``GSPO_TEST_KILL_AT rollout:4: SIGKILL (...)``). The points:

- ``rollout``: an answer of the SGLang engine arrived while other requests of ours are still in
  flight on a server (``rollout/sglang/sample_runner.py``). With ``rollout.max_staleness=1`` the
  rollout generated during loop step s is step s + 1's (or step s's, if it is still running).
- ``sync``: inside a weight update, after its first bucket was sent and before the session
  ended: the servers are paused, in a weight-update session, half updated, and hold the
  broadcast group (``weight_sync/sync.py``).
- ``checkpoint``: between the files of step ``<step>``'s checkpoint: everything but
  ``manifest.json`` is in ``step_<step>.partial/`` (``learner/checkpoint_write.py``, rank 0; a
  save written in the background reaches it while the next step runs).

The variable is read once, when this module is imported; unset, :func:`armed` is one comparison
with None. A malformed value fails the import, naming the variable. Every rank of a learner world
reads it; a point reached only on rank 0 (``checkpoint``) leaves the others to the launcher.
Used by ``tests/test_trainer_loop_real_sglang.py``.
"""

from __future__ import annotations

import os
import signal
from typing import Optional, Tuple

ENV_VAR = "GSPO_TEST_KILL_AT"
POINTS = ("rollout", "sync", "checkpoint")


def parse(value: Optional[str]) -> Optional[Tuple[str, int]]:
    """``"sync:4"`` -> ``("sync", 4)``; None or empty -> None; anything else: ValueError."""
    if not value:
        return None
    point, _, step = value.partition(":")
    if point not in POINTS or not step.isdigit():
        raise ValueError(f"{ENV_VAR}={value!r}: expected <point>:<step> with <point> one of "
                         f"{', '.join(POINTS)} and <step> an RL step (0, 1, ...)")
    return point, int(step)


_TARGET = parse(os.environ.get(ENV_VAR))
_step = 0


def enter_step(step: int) -> None:
    """The loop begins RL step ``step`` (the trainer calls it once per step)."""
    global _step
    _step = step


def armed(point: str, step: Optional[int] = None) -> bool:
    """Whether reaching ``point`` now kills the process (False whenever the variable is unset);
    ``step``: the RL step the point belongs to, when not the loop's current one (a checkpoint
    written in the background is finished during the next step)."""
    return _TARGET is not None and _TARGET == (point, _step if step is None else step)


def kill(point: str, detail: str, step: Optional[int] = None) -> None:
    """Say where (``step`` as in :func:`armed`) and what was in flight (``detail``) on stderr,
    then SIGKILL this process."""
    os.write(2, f"{ENV_VAR} {point}:{_step if step is None else step}: SIGKILL ({detail})\n"
             .encode())
    os.kill(os.getpid(), signal.SIGKILL)

"""Every test leaves the interpreter as it found it: no thread still running, a sound context.

Issue 41: one full-suite run in three failed 9 tests with ``LookupError`` from
``ContextVar.reset`` (omegaconf's and wandb's), each raised long after whatever broke the
main thread's ``contextvars`` state, so the failure named the victims, not the culprit. This
plugin checks after every test, so a test that leaves a thread running or the context broken
fails itself, by name:

* threads: a thread the test started and that is still alive ``THREAD_GRACE_S`` after it (a
  server's request thread finishing its answer has that long) is an error naming the thread;
* context: a variable set in the main thread, while another thread makes contexts, must still
  be there to reset (what the victims' ``reset`` found missing).

Two kinds of thread are not leaks: a library's one thread per process, started on first use
and reused (``PROCESS_WIDE_THREADS``), and a thread a test names with
``@pytest.mark.leaves_threads(name, reason=...)``, which must say what ends it.

``--cpu-durations=N`` (``tests/cpu_durations.py``, loaded here) prints the N tests and modules
that cost the most CPU-seconds, the measure of the suite's budget that load barely moves.
``tests/ahead.py`` (loaded here) runs slow tests' self-contained commands in the background
while the tests before them run.
"""

from __future__ import annotations

import contextvars
import threading
import time

import pytest

pytest_plugins = ("tests.cpu_durations", "tests.ahead", "tests.module_order")
THREAD_GRACE_S = 5.0
PROCESS_WIDE_THREADS = ("tqdm_monitor", "_ResourceSharer._serve")
"""tqdm's monitor (started by the first progress bar, e.g. transformers loading a checkpoint)
and multiprocessing's resource sharer (the first handle sent to another process), by thread
name or target."""
_probe: contextvars.ContextVar = contextvars.ContextVar("gspo_test_context_probe")


def context_is_sound() -> bool:
    """Set a variable, let another thread allocate contexts, reset it: False if it vanished."""
    token = _probe.set(True)
    churn = threading.Thread(target=lambda: [contextvars.copy_context() for _ in range(64)],
                             name="context-probe")
    churn.start()
    churn.join()
    try:
        _probe.reset(token)
    except LookupError:
        return False
    return True


def _exempt(thread: threading.Thread, names: tuple) -> bool:
    target = getattr(getattr(thread, "_target", None), "__qualname__", "")
    return any(n == thread.name or n == target for n in PROCESS_WIDE_THREADS + names)


def threads_left_running(before: set, grace_s: float = THREAD_GRACE_S, exempt: tuple = ()) -> list:
    """Threads not in ``before`` (nor exempt) still alive after waiting up to ``grace_s`` in all."""
    deadline = time.monotonic() + grace_s
    left = []
    for thread in threading.enumerate():
        if thread in before or thread is threading.current_thread() or _exempt(thread, exempt):
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            left.append(thread)
    return left


@pytest.fixture(autouse=True)
def leaves_no_thread_and_a_sound_context(request):
    before = set(threading.enumerate())
    marker = request.node.get_closest_marker("leaves_threads")
    if marker and not marker.kwargs.get("reason"):
        pytest.fail(f"{request.node.nodeid}: leaves_threads needs reason= (what ends them)")
    yield
    left = threads_left_running(before, exempt=tuple(marker.args) if marker else ())
    problems = []
    if left:
        problems.append("left threads running: " + ", ".join(
            f"{t.name} (daemon={t.daemon}, target={getattr(t, '_target', None)!r})" for t in left))
    if not context_is_sound():
        problems.append("left the main thread's contextvars state broken: a variable set here "
                        "vanished before its reset (issue 41)")
    if problems:
        pytest.fail(f"{request.node.nodeid} " + "; ".join(problems), pytrace=False)

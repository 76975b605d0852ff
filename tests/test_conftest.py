"""tests/conftest.py's guard fails the test that leaves a thread running or breaks the context.

Each case runs a small test file in a fresh pytest process with this repository's conftest, so
the breakage stays there. The broken context is made the way issue 41's failures looked from
outside: the main thread's context loses its variables behind Python's back (here another
thread's new context empties its variable map, through ctypes), so a ``reset`` finds its
variable gone. A test that breaks it fails at its own teardown, by name.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

LEAKS_A_THREAD = '''
import threading, time

def test_leaks():
    threading.Thread(target=time.sleep, args=(30,), name="forgotten-worker", daemon=True).start()

def test_after():
    pass
'''

BREAKS_THE_CONTEXT = '''
import contextvars, ctypes

def test_breaks():
    api = ctypes.pythonapi
    api.PyThreadState_Get.restype = ctypes.c_void_p
    marker = contextvars.copy_context()
    found = []
    def locate():
        words = (ctypes.c_void_p * 64).from_address(api.PyThreadState_Get())
        found.extend(i for i, w in enumerate(words) if w == id(marker))
    marker.run(locate)
    main_ctx = (ctypes.c_void_p * 64).from_address(api.PyThreadState_Get())[found[0]]
    empty = contextvars.Context()
    empty_vars = ctypes.c_void_p.from_address(id(empty) + 24).value  # PyContext.ctx_vars
    slot = ctypes.c_void_p.from_address(main_ctx + 24)
    real_copy = contextvars.copy_context
    def copy_and_clobber():  # another thread's new context empties the main thread's
        api.Py_IncRef(ctypes.c_void_p(empty_vars))  # the main thread's next set() drops one
        slot.value = empty_vars
        return real_copy()
    contextvars.copy_context = copy_and_clobber

def test_victim():
    pass
'''


def conftest_package(tmp_path: Path) -> Path:
    """``tmp_path/tests``: this repository's conftest and the plugins it loads
    (``tests.cpu_durations``, ``tests.ahead``, ``tests.module_order``), as the package they are
    in here."""
    package = tmp_path / "tests"
    package.mkdir()
    for name in ("__init__.py", "conftest.py", "cpu_durations.py", "ahead.py", "ahead_runner.py",
                 "module_order.py"):
        shutil.copy(REPO / "tests" / name, package / name)
    return package


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    package = conftest_package(tmp_path)
    (package / "test_case.py").write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-o", "markers=leaves_threads", "test_case.py"],
                          cwd=package, capture_output=True, text=True, timeout=120)


def test_a_test_that_leaves_a_thread_running_fails_by_name(tmp_path):
    out = _run(tmp_path, LEAKS_A_THREAD)
    assert out.returncode == 1, out.stdout
    assert "test_case.py::test_leaks left threads running: forgotten-worker" in out.stdout
    assert "2 passed, 1 error" in out.stdout  # an error at its teardown; the next test not blamed


def test_a_test_that_breaks_the_main_context_fails_by_name(tmp_path):
    out = _run(tmp_path, BREAKS_THE_CONTEXT)
    assert out.returncode == 1, out.stdout
    assert "test_case.py::test_breaks left the main thread's contextvars state broken" in out.stdout
    assert "ERROR test_case.py::test_breaks" in out.stdout

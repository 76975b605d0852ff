"""Slow tests' subprocess commands, run ahead in the background of the session (issue 41 item 8).

A test module lists them in a module-level ``AHEAD = {test name: Command(...)}``: a command line
(``{python}``, ``{repo}`` and the command's own directory ``{dir}`` filled in) whose outputs the
test then checks. Once the session has collected its tests, one runner process
(``tests/ahead_runner.py``, nice 19) runs the commands of the collected ones, in the order their
tests come (``early`` ones in a lane of their own), while the tests before them run: on a 2-core
machine most tests keep one core busy (one interpreter, or a trainer that pytest waits for), so
the other core runs these. A test takes its command's result from the ``ahead`` fixture, waiting
for it if it is still running (at the foreground's priority from then on), and checks it exactly
as it checked the command it used to run itself. A command that was not run ahead
(``GSPO_TESTS_AHEAD=0``, or a test not collected at the start) runs in its test.

Only commands that need nothing from the session belong here: a tool or a script run into its
own directory, with no fixture's server, no Slurm. One whose own timing is checked (a memory
sampler, a server's idle-CPU probe, a signal sent 0.5 s after a launch, a start-up deadline)
asks for ``foreground_priority``: it then loses to the foreground what a test of its own would.
``--cpu-durations`` counts a command's CPU-seconds in its test, not in the tests it ran beside.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV_VAR = "GSPO_TESTS_AHEAD"
_PLAN = pytest.StashKey[Dict[str, dict]]()
_RUNNER = pytest.StashKey[subprocess.Popen]()


@dataclass(frozen=True)
class Command:
    """One test's command: ``argv`` run in ``cwd`` with ``env`` added to the environment."""

    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = str(REPO)
    timeout_s: float = 900.0
    waits: bool = False
    """It mostly waits (on the network): it runs beside the others, not in turn."""
    early: bool = False
    """In a lane of its own that starts with the session: a real SGLang server (~3.6 GB) is best
    started while the first tests, which hold no server, run."""
    foreground_priority: bool = False
    """Not at nice 19: its own timing matters (a memory sampler must not miss a peak)."""
    min_available_gib: float = 0.0
    """Started only once the machine has this much memory available (``MemAvailable``): real
    servers run ahead must not meet the foreground's own servers on a 24 GiB machine, in
    whichever order the modules run (``tests/module_order.py``)."""

    def job(self, out_dir: Path) -> dict:
        def fill(text: str) -> str:  # only these three: a command's own braces stay as they are
            for key, value in (("python", sys.executable), ("repo", str(REPO)),
                               ("dir", str(out_dir))):
                text = text.replace("{" + key + "}", value)
            return text

        return {"argv": [fill(a) for a in self.argv], "env": dict(self.env), "cwd": fill(self.cwd),
                "timeout_s": self.timeout_s, "waits": self.waits, "early": self.early,
                "foreground_priority": self.foreground_priority,
                "min_available_gib": self.min_available_gib, "dir": str(out_dir)}


@dataclass
class Result:
    """What the test checks: the command's exit code and output, and its directory."""

    dir: Path
    returncode: int
    stdout: str
    stderr: str
    cpu_s: float


def _command(item) -> Optional[Command]:
    return getattr(item.module, "AHEAD", {}).get(getattr(item, "originalname", item.name))


def pytest_collection_finish(session) -> None:
    if os.environ.get(ENV_VAR, "1") == "0":
        return
    plan = {}
    for item in session.items:
        command = _command(item)
        if command is not None:
            out_dir = session.config._tmp_path_factory.mktemp(f"ahead_{item.name[:40]}")
            plan[item.nodeid] = command.job(out_dir)
    if not plan:
        return
    plan_file = session.config._tmp_path_factory.mktemp("ahead") / "plan.json"
    plan_file.write_text(json.dumps(list(plan.values())))
    with open(plan_file.with_name("runner.log"), "wb") as log:
        runner = subprocess.Popen([sys.executable, str(REPO / "tests" / "ahead_runner.py"),
                                   str(plan_file), "19"], stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    session.config.stash[_PLAN], session.config.stash[_RUNNER] = plan, runner
    ledger = session.config.pluginmanager.get_plugin("cpu-ledger")
    if ledger is not None:
        ledger.clock.exclude(runner.pid)  # its CPU counts in the tests that take the results


def pytest_sessionfinish(session) -> None:
    """End the runner and any command still running: by the process groups started here."""
    runner = session.config.stash.get(_RUNNER, None)
    if runner is None:
        return
    if runner.poll() is None:
        runner.terminate()
        try:
            runner.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
    for job in session.config.stash[_PLAN].values():
        pgid_file, out = Path(job["dir"]) / "pgid", Path(job["dir"]) / "result.json"
        if pgid_file.exists() and not out.exists():
            try:
                os.killpg(int(pgid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _to_the_foreground(root: int) -> None:
    """Every thread of ``root`` and its descendants at this process's nice value: the session
    now waits for it. Lowering a nice value needs root (``make test`` is: the local Slurm); else
    nothing changes."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    parents = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                parents[int(name)] = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, grew = {root}, True
    while grew:
        before = len(tree)
        tree |= {pid for pid, ppid in parents.items() if ppid in tree}
        grew = len(tree) > before
    for pid in tree:
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
            try:
                if os.getpriority(os.PRIO_PROCESS, int(tid)) > own:
                    os.setpriority(os.PRIO_PROCESS, int(tid), own)
            except OSError:  # gone, or not allowed
                pass


def _wait(job: dict, runner: subprocess.Popen) -> dict:
    out_dir = Path(job["dir"])
    deadline = time.monotonic() + 2 * job["timeout_s"] + 600  # queued behind others, at most
    raised_at = 0.0
    while not (out_dir / "result.json").exists():
        if runner.poll() is not None and not (out_dir / "result.json").exists():
            log = Path(runner.args[2]).with_name("runner.log")
            raise AssertionError(f"the ahead runner ended ({runner.returncode}) before "
                                 f"{job['argv']} did:\n{log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"{job['argv']} not done in time"
        if (out_dir / "pgid").exists() and time.monotonic() - raised_at > 2.0:
            _to_the_foreground(int((out_dir / "pgid").read_text()))  # and its new processes
            raised_at = time.monotonic()
        time.sleep(0.2)
    return json.loads((out_dir / "result.json").read_text())


@pytest.fixture
def ahead(request, tmp_path) -> Result:
    """This test's command's result: run ahead, else run now into ``tmp_path``."""
    command = _command(request.node)
    assert command is not None, f"{request.node.nodeid} has no entry in its module's AHEAD"
    job = request.config.stash.get(_PLAN, {}).get(request.node.nodeid)
    if job is None:  # not run ahead: the same command, here and now
        job = command.job(tmp_path)
        (tmp_path / "result.json").unlink(missing_ok=True)
        subprocess.run([sys.executable, str(REPO / "tests" / "ahead_runner.py"),
                        _write_plan(tmp_path, job)], check=True, timeout=job["timeout_s"] + 60)
        out = json.loads((tmp_path / "result.json").read_text())
    else:
        out = _wait(job, request.config.stash[_RUNNER])
        request.node.user_properties.append(("ahead_cpu_s", out["cpu_s"]))
    out_dir = Path(job["dir"])
    return Result(out_dir, out["returncode"], (out_dir / "stdout").read_text(errors="replace"),
                  (out_dir / "stderr").read_text(errors="replace"), out["cpu_s"])


def _write_plan(out_dir: Path, job: dict) -> str:
    path = out_dir / "plan.json"
    path.write_text(json.dumps([job]))
    return str(path)

"""tests/ahead.py: a slow test's command runs in the background while the tests before it run, the
test gets its exit code, output and directory as if it had run it, a command a test waits for
runs at the foreground's priority from then on, a command past its timeout is killed, the
session's end (or its death) stops what still runs, its CPU-seconds count in its own test; with
GSPO_TESTS_AHEAD=0 each command runs in its test. Each case is a fresh pytest process with this
repository's conftest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

from tests.test_conftest import conftest_package

CASE = '''
import json, os, time
from pathlib import Path
import pytest
from tests.ahead import Command

STAMP = "import sys, time; open(sys.argv[1], 'w').write(repr(time.time())); "
BURN = "import time\\nend = time.process_time() + 0.5\\nwhile time.process_time() < end: pass"
AHEAD = {
    "test_takes_its_result": Command(["{python}", "-c", STAMP + "print('out'); sys.exit(3)",
                                      "{dir}/started"]),
    "test_takes_a_burn": Command(["{python}", "-c", BURN]),
    "test_takes_a_timeout": Command(["{python}", "-c", "import time; time.sleep(60)"], timeout_s=1),
    "test_waits_at_the_foregrounds_priority": Command(
        ["{python}", "-c", "import os, time; time.sleep(4); print(os.nice(0))"]),
}

def test_first():
    time.sleep(3.0)  # the commands run meanwhile

@pytest.fixture
def began():
    return time.time()

def test_takes_its_result(began, ahead):
    started = float((ahead.dir / "started").read_text())
    Path(os.environ["OUT"]).write_text(repr(began - started))  # > 0: it ran before this test
    assert (ahead.returncode, ahead.stdout) == (3, "out\\n") and ahead.stderr == ""

def test_takes_a_burn(ahead):
    assert ahead.returncode == 0 and ahead.cpu_s >= 0.4

def test_takes_a_timeout(ahead):
    assert ahead.returncode == -9

def test_waits_at_the_foregrounds_priority(ahead):
    # ahead: started at nice 19, at this test's once it waited for it (lowering needs root);
    # run in its test: at the test's own
    started = json.loads((ahead.dir / "result.json").read_text())["nice"]
    own = os.nice(0)
    if os.environ.get("GSPO_TESTS_AHEAD") == "0":
        assert (started, ahead.stdout.split()) == (own, [str(own)])
    else:
        assert (started, ahead.stdout.split()) == (19, [str(own if os.geteuid() == 0 else 19)])
'''


def _session(tmp_path, *args, **env):
    package = conftest_package(tmp_path)
    (package / "test_case.py").write_text(textwrap.dedent(CASE))
    environ = dict(os.environ, OUT=str(tmp_path / "lead"), **env)
    environ.pop("GSPO_CPU_DURATIONS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_case.py", *args], cwd=package, capture_output=True, text=True,
                          timeout=300, env=environ)


def test_commands_run_ahead_and_their_tests_check_the_results(tmp_path):
    out = _session(tmp_path, "--cpu-durations=0", "--cpu-durations-file",
                   str(tmp_path / "cpu.jsonl"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert float((tmp_path / "lead").read_text()) > 0  # started while test_first slept
    rows = {json.loads(line)["test"].split("::")[1]: json.loads(line)
            for line in (tmp_path / "cpu.jsonl").read_text().splitlines()}
    burn = rows["test_takes_a_burn"]
    assert burn["ahead"] >= 0.4 and burn["cpu"] < burn["ahead"] + 0.3, burn  # in its row, once
    assert rows["test_first"]["cpu"] < 0.3, rows["test_first"]  # not in the test it ran beside


def test_with_ahead_off_each_command_runs_in_its_test(tmp_path):
    out = _session(tmp_path, GSPO_TESTS_AHEAD="0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert float((tmp_path / "lead").read_text()) < 0  # started in its own test


def test_the_sessions_end_stops_a_command_still_running(tmp_path):
    package = conftest_package(tmp_path)
    (package / "test_case.py").write_text(textwrap.dedent('''
        from tests.ahead import Command
        AHEAD = {"test_later": Command(["{python}", "-c",
                 "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                 "time.sleep(120)", "{dir}/pid"])}
        def test_fails_first():
            import time; time.sleep(1.0)
            assert False
        def test_later(ahead):
            pass
    '''))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          "test_case.py", "--basetemp", str(tmp_path / "base")], cwd=package,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "1 failed" in out.stdout, out.stdout + out.stderr
    pid = int(next((tmp_path / "base").rglob("pid")).read_text())
    try:  # gone, or a zombie until init reaps it
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return
    assert state == "Z", f"the command {pid} outlived its session"


def test_a_killed_session_leaves_no_command_running(tmp_path):
    package = conftest_package(tmp_path)
    (package / "test_case.py").write_text(textwrap.dedent('''
        import time
        from tests.ahead import Command
        AHEAD = {"test_later": Command(["{python}", "-c",
                 "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                 "time.sleep(120)", "{dir}/pid"])}
        def test_long():
            time.sleep(120)
        def test_later(ahead):
            pass
    '''))
    session = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                "test_case.py", "--basetemp", str(tmp_path / "base")], cwd=package,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "base").rglob("pid")) and time.monotonic() < deadline:
            time.sleep(0.1)
        pid = int(next((tmp_path / "base").rglob("pid")).read_text())
    finally:
        session.kill()  # no sessionfinish: the runner sees its parent gone
        session.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the command {pid} outlived its killed session")


def test_a_command_waits_for_the_memory_it_asks_for(tmp_path):
    """``min_available_gib``: a command whose memory is not available does not start (the lane
    behind it waits too), while the other lane runs."""
    from tests import ahead_runner

    have = ahead_runner.available_gib()
    assert 0 < have < 10**4
    assert ahead_runner.fits({"min_available_gib": 0.0})
    assert not ahead_runner.fits({"min_available_gib": have + 10**6})
    jobs = []
    for name, early, gib in (("big", True, have + 10**6), ("small", False, 0.0)):
        (tmp_path / name).mkdir()
        jobs.append({"argv": [sys.executable, "-c", "print('ran')"], "env": {}, "cwd": str(tmp_path),
                     "timeout_s": 60, "waits": False, "early": early, "foreground_priority": False,
                     "min_available_gib": gib, "dir": str(tmp_path / name)})
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(jobs))
    runner = subprocess.Popen([sys.executable, ahead_runner.__file__, str(plan)])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "small" / "result.json").exists():
            assert time.monotonic() < deadline and runner.poll() is None
            time.sleep(0.1)
        time.sleep(1.0)  # five of the runner's polls
        assert not (tmp_path / "big" / "pgid").exists()  # never started
        assert runner.poll() is None  # still waiting for it
    finally:
        runner.terminate()
        runner.wait(timeout=30)

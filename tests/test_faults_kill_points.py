"""The kill-point test hook (``gspo_megatron/faults/kill_points.py``): inert when unset, kills
exactly at its point and step, refuses a malformed value naming the variable. Each case runs in a
fresh interpreter, since the variable is read once, at import."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.faults import kill_points

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
from gspo_megatron.faults import kill_points as k
seen = []
for step in (0, 3, 4):
    k.enter_step(step)
    seen += [f"{p}:{step}" for p in k.POINTS if k.armed(p)]
print("armed at", seen, flush=True)
k.enter_step(4)
if k.armed("sync"):
    k.kill("sync", "bucket 1 sent")
print("survived", flush=True)
"""


def _run(value):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(kill_points.ENV_VAR, None)
    if value is not None:
        env[kill_points.ENV_VAR] = value
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=60)


def test_parse_reads_point_and_step_and_refuses_anything_else():
    assert kill_points.parse(None) is None and kill_points.parse("") is None
    assert kill_points.parse("checkpoint:12") == ("checkpoint", 12)
    for bad in ("sync", "sync:", "sync:-1", "sync:x", "elsewhere:3", ":3"):
        with pytest.raises(ValueError, match=rf"GSPO_TEST_KILL_AT={bad!r}: expected <point>:<step>"):
            kill_points.parse(bad)


def test_the_process_kills_itself_at_its_point_and_step_only():
    out = _run("sync:4")
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert "armed at ['sync:4']" in out.stdout and "survived" not in out.stdout
    assert "GSPO_TEST_KILL_AT sync:4: SIGKILL (bucket 1 sent)" in out.stderr


def test_unset_or_another_step_leaves_the_process_alone():
    for value in (None, "sync:5", "rollout:4"):
        out = _run(value)
        assert out.returncode == 0, (value, out.stderr)
        expected = "['rollout:4']" if value == "rollout:4" else "[]"
        assert f"armed at {expected}" in out.stdout and "survived" in out.stdout, value


def test_a_malformed_value_fails_at_import_naming_the_variable():
    out = _run("sync-4")
    assert out.returncode == 1
    assert "GSPO_TEST_KILL_AT='sync-4': expected <point>:<step>" in out.stderr


def test_a_point_of_an_earlier_step_fires_when_reached_in_the_next():
    """A checkpoint written in the background is finished during the next step: the hook names
    the step the checkpoint holds, not the loop's current one."""
    script = ("from gspo_megatron.faults import kill_points as k\n"
              "k.enter_step(5)\n"
              "print('own step', k.armed('checkpoint'), 'step 4', k.armed('checkpoint', 4),"
              " flush=True)\n"
              "k.kill('checkpoint', 'step_000004.partial', 4)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), **{kill_points.ENV_VAR: "checkpoint:4"})
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert "own step False step 4 True" in out.stdout
    assert "GSPO_TEST_KILL_AT checkpoint:4: SIGKILL (step_000004.partial)" in out.stderr

"""The multi-process test fixture: ranks come from the preloaded fork server, with the caller's
environment, and a failing rank fails the test with its traceback."""

from __future__ import annotations

import os
import sys

import pytest

from tests.multiproc import run_on_ranks


def _what_the_rank_sees(rank):
    return {"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"],
            "marker": os.environ.get("GSPO_MULTIPROC_MARKER"), "cwd": os.getcwd(),
            "preloaded": "tests.rank_preload" in sys.modules,
            "megatron": "megatron.core.parallel_state" in sys.modules}


def _fail_on_rank_one(rank):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def test_ranks_fork_from_the_preloaded_server_with_the_callers_environment(monkeypatch,
                                                                           tmp_path):
    """The fork server imported Megatron-Core once (if its preload failed, forkserver would
    silently start bare processes and every multi-process test would pay the imports again);
    each rank sees the environment and working directory of the call, not the ones the server
    started with."""
    for marker in ("first", "second"):
        monkeypatch.setenv("GSPO_MULTIPROC_MARKER", marker)
        (tmp_path / marker).mkdir()
        monkeypatch.chdir(tmp_path / marker)
        seen = run_on_ranks(_what_the_rank_sees, world_size=2)
        assert [s["rank"] for s in seen] == ["0", "1"] and {s["world"] for s in seen} == {"2"}
        assert all(s["marker"] == marker and s["cwd"] == str(tmp_path / marker) for s in seen)
        assert all(s["preloaded"] and s["megatron"] for s in seen)


def test_a_failing_rank_fails_the_call_with_its_traceback():
    with pytest.raises(AssertionError, match="rank 1 failed:(.|\n)*rank one refuses"):
        run_on_ranks(_fail_on_rank_one, world_size=2, timeout_s=120)

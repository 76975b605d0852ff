"""benchmarks/bench_preemption.py: its table, and the recorded trials in docs/cluster.md (every
trial checkpointed what it said, resumed from it, and trained each step once)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import bench_preemption as bench  # noqa: E402


def test_the_table_says_what_each_trial_did():
    trials = [{"after_step": 2, "late": False, "outcome": "finished and saved",
               "checkpoint_step": 3, "resumed_step": 3, "repeats": 4, "steps_once": True,
               "state": "COMPLETED 0:0, restarts 1"},
              {"after_step": 2, "late": True, "outcome": "dropped, saved the one before",
               "checkpoint_step": 2, "resumed_step": 2, "repeats": 1, "steps_once": False,
               "state": "COMPLETED 0:0, restarts 1"}]
    rows = bench.table(trials)
    assert rows[2] == ("| 1 | after step 2 | finished and saved | step 3 | step 3 | 4 | yes | "
                       "COMPLETED 0:0, restarts 1 |")
    assert "end moved to 22 s ahead | dropped, saved the one before" in rows[3]
    assert "| NO |" in rows[3]


def test_the_recorded_trials_resumed_from_what_they_saved():
    doc = (REPO / "docs" / "cluster.md").read_text()
    section = doc.split(bench.BEGIN, 1)[1].split(bench.END, 1)[0]
    rows = [r.split(" | ") for r in section.splitlines() if r.startswith("| ") and r[2].isdigit()]
    assert len(rows) == 4, section
    for row in rows:
        assert row[3] == row[4], row  # checkpoint == resumed from
        assert row[6] == "yes" and row[7].startswith("COMPLETED 0:0"), row
    assert rows[3][2] == "dropped, saved the one before"  # the late warning's path

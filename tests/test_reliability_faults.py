"""tools/reliability/: a fault's verdict can fail. Every fault itself runs, and is compared with
its committed row, in tests/test_reliability_table.py (all 24 of them, two at a time)."""

from __future__ import annotations

from tools.reliability import fault_kit
from tools.reliability.fault_kit import FAULTS, all_faults, fault, first_problem, no_traceback
from tools.reliability.harness import Workspace


def test_a_fault_script_that_breaks_is_a_failed_row_not_a_vanished_one(tmp_path, monkeypatch):
    monkeypatch.setattr(fault_kit, "FAULTS", list(FAULTS))

    @fault("broken script", "raise inside the fault")
    def broken(ws, d):
        raise RuntimeError("boom")

    @fault("unhandled", "the run did the wrong thing")
    def unhandled(ws, d):
        return "1", "some line", "rerun exited 1"

    ws = Workspace(tmp_path)
    row = broken(ws)
    assert (row.ok, row.exit_codes) == (False, "-") and "fault script failed" in row.verdict
    assert "boom" in row.verdict
    row = unhandled(ws)
    assert (row.ok, row.verdict, row.line) == (False, "rerun exited 1", "some line")
    assert fault_kit.FAULTS[-2:] == [broken, unhandled]


def test_problems_are_found_in_order_and_tracebacks_in_logs(tmp_path):
    assert first_problem((True, "a"), (False, "b"), (False, "c")) == "b"
    assert first_problem((True, "a")) is None
    (tmp_path / "train.log").write_text("fine\n")
    assert no_traceback(tmp_path)[0]
    (tmp_path / "rerun.log").write_text("Traceback (most recent call last):\n  File x\nValueError\n")
    ok, message = no_traceback(tmp_path)
    assert not ok and "rerun.log" in message


def test_every_fault_has_a_unique_name():
    names = [f.name for f in all_faults()]
    assert len(names) == len(set(names)) >= 20

"""tools/reliability_table.py: every bad input and fault runs for real and its outcome must equal
the committed row of docs/reliability.md, its verdicts can fail, and the doc covers every case."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.reliability import bad_inputs
from tools.reliability.fault_kit import all_faults
from tools.reliability.bad_inputs import BadInput, run_bad_input
from tools.reliability.harness import Workspace
from tools.reliability_table import render
from tests.ahead import Command

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("reliability"))


def test_verdicts_catch_silent_acceptance_and_unclear_errors(ws):
    accepted = BadInput("help is not an error", "export", lambda ws, d: ["--help"], "anything")
    unclear = BadInput("error without the key", "train", bad_inputs._train("trainer.num_steps=-1"),
                       "the text we wanted")

    def argv_that_writes(ws, d):  # stands for a command that leaves a file behind
        (d / "left_behind").write_text("x")
        return ["--ckpt", str(d / "none"), "--out", str(d / "o")]

    wrote = BadInput("writes a file", "export", argv_that_writes, "neither")
    assert run_bad_input(ws, accepted).verdict == "silent acceptance"
    assert run_bad_input(ws, unclear).verdict.startswith("unclear error")
    assert run_bad_input(ws, wrote).verdict == "wrote ['left_behind']"


def test_rendered_table_counts_and_marks_failures():
    from tools.reliability.harness import Result

    results = [Result("bad input", "a", "gspo-train x=1", "2", "/scratch/a: bad", True, "clear error"),
               Result("fault", "b", "kill", "0", "", False, "survivors: [12]")]
    text = render(results, "/scratch", "python tools/reliability_table.py", 90.0)
    assert "**1 of 2 ok**: 1 of 1 bad inputs, 0 of 1 faults" in text
    assert "| 1 | a | `gspo-train x=1` | 2 | <ws>/a: bad | ok |" in text
    assert "**FAIL**: survivors: [12]" in text


def test_committed_document_lists_every_case_and_all_are_ok():
    text = (REPO / "docs" / "reliability.md").read_text()
    summary = re.search(r"\*\*(\d+) of (\d+) ok\*\*: (\d+) of (\d+) bad inputs, (\d+) of (\d+) "
                        r"faults", text)
    assert summary, "docs/reliability.md has no summary line; rerun tools/reliability_table.py"
    ok, total, bad_ok, bad, fault_ok, fault = map(int, summary.groups())
    assert (bad, fault) == (len(bad_inputs.CASES), len(all_faults())), "rerun the tool"
    assert bad >= 60 and fault >= 20
    assert ok == total and "**FAIL**" not in text


AHEAD = {"test_every_committed_row_is_what_the_code_answers_today": Command(
    ["{python}", "{repo}/tools/reliability_table.py", "--kind", "faults", "--work-dir", "{dir}/ws",
     "--out", "{dir}/faults.md"], foreground_priority=True)}
"""The faults (the trainer as subprocesses, two at a time, ~170 CPU-seconds), run by the tool in
the background while the tests before this one run (``tests/ahead.py``); at the foreground's
priority, so that their timings resemble the committed table's (the start-up fault no longer
depends on it: it waits for the trainer's handler in ``/proc``, see ``sigusr1_at_start``)."""


@pytest.mark.slow
def test_every_committed_row_is_what_the_code_answers_today(tmp_path, ahead):
    """The table cannot go stale: every bad input (in this process, ~25 s) and every fault
    (``AHEAD``) runs again here, and each row's outcome must equal the committed one: bad inputs
    word for word, faults with their numbers masked."""
    from tools.reliability_table import outcome, run_all, table_rows

    bad = run_all(Workspace(tmp_path), kinds=("bad",))
    fresh = {"Bad inputs": render(bad, str(tmp_path), "x", 0.0)}
    assert (ahead.dir / "faults.md").is_file(), ahead.stdout + ahead.stderr[-3000:]
    fresh["Faults"] = (ahead.dir / "faults.md").read_text()  # exit 1 if a fault failed: its row says
    committed_doc = (REPO / "docs" / "reliability.md").read_text()
    for section, exact in (("Bad inputs", True), ("Faults", False)):
        committed, rows = table_rows(committed_doc, section), table_rows(fresh[section], section)
        assert [c[1] for c in committed] == [f[1] for f in rows], f"{section}: rerun the tool"
        for old, new in zip(committed, rows):
            same = old == new if exact else outcome(old) == outcome(new)
            assert same, (f"docs/reliability.md is stale ({section}): rerun `python "
                          f"tools/reliability_table.py`\n  committed: {old}\n  today:     {new}")
        assert "**FAIL**" not in fresh[section]


def test_a_fault_row_differs_when_its_outcome_does_not_when_only_numbers_do():
    from tools.reliability_table import outcome, table_rows

    row = ("| 8 | Two jobs | `start a second job` | 0 and 2 | gspo-train: run directory is in use "
           "by PID 26975 on <host>, started 2026-12-05T05:17:51+0000 \\| lock | ok |")
    doc = lambda r: f"## Faults (1)\n\n| # | case | how | exit | line | verdict |\n|---|\n{r}\n"  # noqa: E731
    base = table_rows(doc(row), "Faults")[0]
    assert base[4].endswith("\\| lock")  # an escaped | stays inside its cell
    assert outcome(table_rows(doc(row.replace("26975", "31"). replace("05:17", "06:01")), "Faults")[0]) == outcome(base)
    for changed in (row.replace("0 and 2", "0 and 0"), row.replace("| ok |", "| **FAIL**: x |"),
                    row.replace("in use", "free")):
        assert outcome(table_rows(doc(changed), "Faults")[0]) != outcome(base)


def test_a_full_disk_row_is_the_same_whatever_the_writer_said():
    """Where a write into a full tmpfs fails decides the writer's words (the committed row said
    torch's serializer, a fresh clone's run DCP's failure map): masked; the path and what was
    being written are not."""
    from tools.reliability_table import outcome

    def cells(detail: str, path: str = "<ws>/x/mnt/run/checkpoints/step_000002") -> list:
        return ["19", "Disk fills", "`how`", "4 then 0",
                f"gspo_megatron.learner.checkpoint_write: no space left on {path} while writing "
                f"checkpoint step_000002 ({detail}); removed {path}.partial", "ok"]

    serializer = cells("0 B free; the writer reported: Worker failure: [enforce fail at "
                       "inline_container.cc:672] . unexpected pos 704 vs 598")
    assert outcome(cells("OSError: [Errno 28] No space left on device")) == outcome(serializer)
    assert outcome(cells("No space left on device", path="<ws>/y")) != outcome(serializer)

"""tools/reliability_table.py: a representative subset of its bad inputs and faults run for real,
its verdicts can fail, and the committed docs/reliability.md covers every case, all ok."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.reliability import bad_inputs, faults
from tools.reliability.fault_kit import all_faults
from tools.reliability.bad_inputs import BadInput, run_bad_input
from tools.reliability.harness import Workspace
from tools.reliability_table import render

REPO = Path(__file__).resolve().parents[1]
SUBSET = ["override without '='", "negative RL steps", "zero new tokens", "binary train file",
          "model.hf_path does not exist", "config.json sizes do not match the weights",
          "checkpoint.load_dir missing a shard", "export --max-shard-size garbage",
          "export from a checkpoint missing a file", "train with no arguments"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("reliability"))


def test_subset_of_bad_inputs_gets_clear_errors(ws):
    cases = {c.name: c for c in bad_inputs.CASES}
    results = [run_bad_input(ws, cases[name]) for name in SUBSET]
    assert [(r.name, r.verdict) for r in results if not r.ok] == []
    assert all(r.exit_codes == "2" for r in results)


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


@pytest.mark.slow
@pytest.mark.parametrize("fault", [faults.sigusr1_at_start, faults.damaged_common],
                         ids=lambda f: f.__name__)
def test_subset_of_faults_is_handled(ws, fault):
    result = fault(ws)
    assert result.ok, (result.verdict, result.line)


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


def _rows(text: str, section: str) -> list:
    part = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return [line for line in part.splitlines() if line.startswith("| ") and not line.startswith("| # ")]


def test_the_committed_bad_input_rows_are_what_the_code_answers_today(tmp_path):
    """The table cannot go stale: every bad input runs again here (about 20 s, one process) and
    its rows must equal the committed ones, message for message. The faults (6 min of trainer
    runs) are checked by name and procedure; tests/test_reliability_faults.py runs most of them."""
    from tools.reliability_table import run_all

    results = run_all(Workspace(tmp_path), kinds=("bad",))
    fresh = _rows(render(results, str(tmp_path), "x", 0.0), "Bad inputs")
    committed = _rows((REPO / "docs" / "reliability.md").read_text(), "Bad inputs")
    stale = [(old, new) for old, new in zip(committed, fresh) if old != new]
    assert len(committed) == len(fresh) and not stale, (
        "docs/reliability.md is stale: rerun `python tools/reliability_table.py`; first difference:\n"
        f"  committed: {stale[0][0] if stale else len(committed)}\n  today:     {stale[0][1] if stale else len(fresh)}")
    faults_doc = _rows((REPO / "docs" / "reliability.md").read_text(), "Faults")
    assert [row.split(" | ")[1] for row in faults_doc] == [f.name for f in all_faults()]

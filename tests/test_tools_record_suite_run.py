"""tools/record_suite_run.py: a CI log's facts into docs/test_suite.md, rows kept across runs."""

from __future__ import annotations

import pytest

from tools.record_suite_run import LogError, main, parse_log, update_doc

GREEN = """== 2026-12-06T05:20:01Z CI on abc1234
== start 2026-12-06T05:20:01Z cpus 2 load 0.52 0.40 0.33
....... [100%]
============================= slowest 15 durations =============================
61.02s call     tests/test_slurm_pipeline.py::test_real_trainer_preempted
7.87s teardown tests/test_trainer_loop.py::test_x
1123 passed, 84 warnings in 1109.50s (0:18:29)
== end 2026-12-06T05:44:10Z cpus 2 load 1.91 1.70 1.20
== wall 1449 s, exit 0
"""
RED = GREEN.replace("1123 passed, 84 warnings", "9 failed, 1114 passed, 84 warnings").replace(
    "exit 0", "exit 2").replace("abc1234", "def5678")


def test_a_green_then_a_red_run_are_both_kept_with_their_conditions(tmp_path):
    facts = parse_log(GREEN)
    assert (facts["commit"], facts["cpus"], facts["load_start"], facts["load_end"]) == ("abc1234", 2, 0.52, 1.91)
    assert facts["counts"] == {"passed": 1123} and facts["pytest_s"] == 1109.5 and facts["wall_s"] == 1449
    assert facts["slowest"][0] == ("61.02", "call", "tests/test_slurm_pipeline.py::test_real_trainer_preempted")
    doc = update_doc("# Test suite\n", facts, "fresh clone 1")
    doc = update_doc(doc, parse_log(RED), "fresh clone 2")
    assert "| fresh clone 1 | `abc1234` | 2026-12-06T05:20:01Z | 2 | 0.5 / 1.9 | **green**: 1123 passed | 18:29 | 24:09 |" in doc
    assert "| fresh clone 2 | `def5678` |" in doc and "**red**: 9 failed or errors, 1114 passed" in doc
    assert doc.count("| label |") == 1 and doc.startswith("# Test suite")
    assert "last recorded run (fresh clone 2, `def5678`)" in doc and "`tests/test_trainer_loop.py::test_x`" in doc
    log = tmp_path / "ci.log"
    log.write_text(GREEN)
    out = tmp_path / "suite.md"
    assert main([str(log), "--label", "x", "--doc", str(out)]) == 0 and "| x | `abc1234`" in out.read_text()


def test_a_log_that_is_not_from_ci_run_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(LogError, match="ci.log: no '== wall' line"):
        parse_log(GREEN.replace("== wall 1449 s, exit 0\n", ""), "ci.log")
    assert main([str(tmp_path / "missing.log"), "--label", "x", "--doc", str(tmp_path / "d.md")]) == 2
    assert "missing.log" in capsys.readouterr().err

"""The report's numbers and verdict rules: phases of a run, per-phase means, separation by the
seed spread, collapse, "the same", orders of magnitude, and the parameter count of a model file."""

from __future__ import annotations

from gspo_megatron.experiments.paper_numbers import (close, collapsed, end_accuracy,
                                                     mean_accuracy, num_parameters,
                                                     orders_of_magnitude, phase_mean, phases,
                                                     ratio, separation)
from tests.paper_runs import write_assets


def test_phases_of_the_paper_run_and_of_a_two_step_smoke():
    ph = phases(200)
    assert [ph[k].label for k in ("run", "early", "late")] == ["steps 1-200", "steps 1-100",
                                                               "steps 151-200"]
    assert (ph["last10"].first, ph["last20"].first) == (191, 181)
    smoke = phases(2)
    assert all(1 <= p.first <= p.last == 2 for k, p in smoke.items() if k != "early")
    assert (smoke["early"].first, smoke["early"].last) == (1, 1)


def test_phase_mean_and_accuracies_skip_the_start():
    rows = [{"step": 0, "x": 100.0, "eval/accuracy": 0.1}] + \
        [{"step": s, "x": float(s)} for s in range(1, 5)]
    rows[2]["eval/accuracy"], rows[4]["eval/accuracy"] = 0.5, 0.3
    assert phase_mean("x", phases(4)["run"])(rows) == 2.5
    assert phase_mean("x", phases(4)["late"])(rows) == 4.0 and phase_mean("y", phases(4)["run"])(rows) is None
    assert end_accuracy(rows) == 0.3 and mean_accuracy(rows) == 0.4
    assert collapsed(rows) is True and collapsed(rows[:3]) is False  # 0.3 < 0.5 - 0.1


def test_verdict_rules():
    assert separation([0.70, 0.72, 0.65], [0.69, 0.71, 0.62]) == "not separated"
    assert separation([0.90, 0.92, 0.91], [0.69, 0.71, 0.62]) == "ahead"
    assert separation([0.60, 0.61, 0.60], [0.70, 0.71, 0.70]) == "behind"
    assert close(0.30, 0.28) and not close(0.30, 0.25)
    assert [orders_of_magnitude(r) for r in (7.5, 13, 50, 150, 0.5)] == [1, 1, 2, 2, 0]
    assert (ratio(0.3, 0.01), ratio(0.3, 0.0), ratio(0.0, 0.0)) == (30.0, float("inf"), 1.0)


def test_parameters_are_counted_from_the_safetensors_header(tmp_path):
    write_assets(tmp_path)
    assert num_parameters(tmp_path / "assets" / "model" / "model.safetensors") == 17

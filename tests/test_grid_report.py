"""grid/report.py: the table's numbers from each point's metrics.jsonl, the Markdown / CSV files
and the figures, written again on every call (also while points still run)."""

from __future__ import annotations

import csv
import json

import pytest

from gspo_megatron.grid.report import summarize, write_report
from gspo_megatron.grid.spec import GridRecord
from gspo_megatron.grid.state import PointState


def _rows(n, reward0, acc=None):
    rows = [{"step": 0, "eval/accuracy": 0.1}] if acc is not None else []
    for s in range(1, n + 1):
        rows.append({"step": s, "reward/mean": reward0 + s / 10, "train/clip_frac_seq": 0.01 * s,
                     "train/clip_frac_token": 0.02 * s, "time/step_s": float(s),
                     "rollout/tokens_per_s": 100.0 * s, "memory/peak_gb": 1.0 + s})
    if acc is not None:
        rows.append({"step": n, "eval/accuracy": acc})
    return rows


def test_summary_of_one_point():
    got = summarize(_rows(6, 0.0, acc=0.5), last=2)
    assert got["step"] == 6 and got["final_accuracy"] == 0.5 and got["best_accuracy"] == 0.5
    assert got["final_reward"] == pytest.approx((0.5 + 0.6) / 2)
    assert got["clip_frac_seq"] == pytest.approx(0.055) and got["clip_frac_token"] == pytest.approx(0.11)
    assert got["s_per_step"] == 3.5 and got["gen_tokens_per_s"] == pytest.approx(350.0)
    assert got["peak_memory_gb"] == 7.0
    assert summarize([], last=2)["step"] is None and summarize([], last=2)["final_reward"] is None


def test_report_files_and_figures(tmp_path):
    points = []
    for i, (lr, loss) in enumerate([(lr, loss) for lr in ("1e-6", "1e-5") for loss in ("gspo", "grpo")]):
        run = tmp_path / f"point_{i}"
        run.mkdir()
        if i != 3:  # point 3 never ran
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(3, i)) + '{"step": 4, "rew')
        points.append({"index": i, "overrides": [f"optimizer.lr={lr}", f"algo.loss={loss}"], "run_dir": str(run)})
    record = GridRecord(name="sweep", script="s.sh", config="c.yaml",
                        axes={"optimizer.lr": ["1e-6", "1e-5"], "algo.loss": ["gspo", "grpo"]}, points=points)
    states = {0: PointState("done", 0), 1: PointState("running"), 2: PointState("failed", 137, "killed"),
              3: PointState("missing")}
    rows = write_report(tmp_path, record, states, last=2)
    assert [r.values["final_reward"] for r in rows[:3]] == pytest.approx([0.25, 1.25, 2.25])
    assert rows[3].values["step"] is None
    md = (tmp_path / "report.md").read_text()
    assert "| point | optimizer.lr | algo.loss | state | step |" in md
    assert "| 2 | `1e-5` | `gspo` | failed (exit 137): killed | 3 |" in md
    assert md.index("| 2 |") < md.index("| 1 |") < md.index("| 0 |")  # best final reward first
    assert "1 done, 1 failed, 1 missing, 1 running" in md
    with open(tmp_path / "report.csv") as f:
        table = list(csv.DictReader(f))
    assert table[2]["state"] == "failed" and table[2]["exit_code"] == "137" and table[3]["step"] == ""
    assert float(table[0]["final_reward"]) == pytest.approx(0.25)
    for name in ("final_reward_vs_optimizer_lr.png", "final_reward_vs_algo_loss.png", "reward_curves.png"):
        assert (tmp_path / name).stat().st_size > 1000 and f"]({name})" in md


def test_the_report_shown_in_cluster_md_is_the_one_the_test_grid_wrote():
    from tests.test_config import REPO

    table = lambda text: [line for line in text.splitlines() if line.startswith("| ")]  # noqa: E731
    written = (REPO / "docs" / "grid_example" / "report.md").read_text()
    shown = (REPO / "docs" / "cluster.md").read_text()
    assert table(written) and table(written)[0].startswith("| point | optimizer.lr | algo.loss | state |")
    assert "\n".join(table(written)) in "\n".join(table(shown))
    for name in ("final_accuracy_vs_optimizer_lr.png", "reward_curves.png"):
        assert (REPO / "docs" / "grid_example" / name).is_file() and f"(grid_example/{name})" in shown

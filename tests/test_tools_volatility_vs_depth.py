"""tools/volatility_vs_depth.py: the per-depth summary, and a smoke run of the whole tool (2 and
4 layers, 2 RL steps each) that writes its table and figure."""

from __future__ import annotations

import pytest

from tests.ahead import Command
from tools import volatility_vs_depth as tool

AHEAD = {"test_smoke_run_writes_the_table_and_the_figure": Command(
    ["{python}", "tools/volatility_vs_depth.py", "--out", "{dir}/runs", "--smoke", "--doc",
     "{dir}/doc.md"])}
"""The smoke's training runs (~30 CPU-seconds), in the background while the tests before it run
(``tests/ahead.py``)."""


def test_summary_means_early_late_and_spread():
    rows = [{"step": s, tool.ACTIVATED: a, tool.TOPK_SET: 2 * a, "time/step_s": 1.0 + s}
            for s, a in enumerate([0.04, 0.02, 0.01, 0.01], start=1)]
    got = tool.run_summary([{"step": 0}] + rows, early=2)
    assert got["steps"] == 4 and got["activated_mean"] == pytest.approx(0.02)
    assert got["activated_early"] == pytest.approx(0.03) and got["activated_late"] == pytest.approx(0.01)
    assert got["topk_set_mean"] == pytest.approx(0.04) and got["s_per_step"] == pytest.approx(3.5)
    assert got["activated_std"] == pytest.approx(0.0122474, rel=1e-4)
    other = [dict(r, **{tool.ACTIVATED: 2 * r[tool.ACTIVATED]}) for r in rows]
    both = tool.summarize([rows, other], early=2)
    assert both["seeds"] == 2 and both["activated_mean"] == pytest.approx(0.03)
    assert (both["activated_min"], both["activated_max"]) == pytest.approx((0.02, 0.04))


@pytest.mark.slow
def test_smoke_run_writes_the_table_and_the_figure(ahead):
    tmp_path = ahead.dir  # where it ran
    doc = tmp_path / "doc.md"
    assert ahead.returncode == 0, ahead.stderr[-3000:]
    text = doc.read_text()
    assert "| 2 | 2 |" in text and "| 4 | 2 |" in text
    assert (tmp_path / "runs" / "volatility_vs_depth.png").stat().st_size > 1000
    assert (tmp_path / "runs" / "layers4" / "assets" / "model" / "config.json").is_file()
    assert '"num_hidden_layers": 4' in (tmp_path / "runs" / "layers4" / "assets" / "model" /
                                        "config.json").read_text()

"""tools/volatility_vs_depth.py: the per-depth summary, and a smoke run of the whole tool (2 and
4 layers, 2 RL steps each) that writes its table and figure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools import volatility_vs_depth as tool

REPO = Path(__file__).resolve().parents[1]


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
def test_smoke_run_writes_the_table_and_the_figure(tmp_path):
    doc = tmp_path / "doc.md"
    proc = subprocess.run([sys.executable, "tools/volatility_vs_depth.py", "--out", str(tmp_path / "runs"),
                           "--smoke", "--doc", str(doc)], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = doc.read_text()
    assert "| 2 | 2 |" in text and "| 4 | 2 |" in text
    assert (tmp_path / "runs" / "volatility_vs_depth.png").stat().st_size > 1000
    assert (tmp_path / "runs" / "layers4" / "assets" / "model" / "config.json").is_file()
    assert '"num_hidden_layers": 4' in (tmp_path / "runs" / "layers4" / "assets" / "model" /
                                        "config.json").read_text()

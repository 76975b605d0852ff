"""tools/volatility_vs_experts.py and ``experiments/paper_experts.py``: routings parsed and
refused, one run's rows summarised, the marked section written into a document and carried over
when ``paper_report`` rewrites it, and a smoke run of the whole tool (tiny widths, the embedded
engine, 8 experts top-2 and 16 top-8, one GSPO step each)."""

from __future__ import annotations

import argparse

import pytest

from gspo_megatron.experiments import paper_experts as pe
from tests.ahead import Command
from tools import volatility_vs_experts as tool

SETTING = {"command": "python tools/volatility_vs_experts.py", "date": "today", "cpus": 2,
           "load": "1.0", "code": "abc", "what": "Compared: two routings."}


def test_routings_are_parsed_and_a_routing_that_cannot_change_is_refused():
    assert tool.parse_routing("128x8") == (128, 8)
    for bad in ("8x8", "8x0", "128", "axb"):
        with pytest.raises(argparse.ArgumentTypeError):
            tool.parse_routing(bad)


def _rows(values):
    return [{"step": 0}] + [{"step": i + 1, pe.ACTIVATED: a, pe.TOPK_SET: 3 * a,
                             "time/step_s": 10.0 * (i + 1)} for i, a in enumerate(values)]


def test_points_section_and_document_round_trip(tmp_path):
    big = pe.point_from_rows(128, 8, _rows([0.10, 0.20, 0.30]))
    tiny = pe.point_from_rows(8, 2, _rows([0.01, 0.03]))
    assert big.activated_mean == pytest.approx(0.2) and big.topk_set_mean == pytest.approx(0.6)
    assert big.s_per_step == 20.0 and len(tiny.activated) == 2
    with pytest.raises(RuntimeError, match="no routing/activated_expert_changed_frac"):
        pe.point_from_rows(16, 8, [{"step": 0}])
    pe.save_points(tmp_path / "p.json", [big, tiny], SETTING)
    points, setting = pe.load_points(tmp_path / "p.json")
    text = pe.section(points, setting)
    assert "| 128 experts top-8 | 3 | 20.00% (10.00%-30.00%) | 60.00% | 20 |" in text
    assert "| 8 experts top-2 | 2 | 2.00% (1.00%-3.00%) |" in text
    assert "20.00% of their activated experts per step" in text and "10.0x" in text
    doc = tmp_path / "doc.md"
    doc.write_text("# Doc\n\nbefore\n\n" + pe.empty_section() + "\n\nafter\n")
    pe.write_section(doc, text)
    assert pe.existing_section(doc) == text
    assert doc.read_text().startswith("# Doc\n\nbefore\n\n") and doc.read_text().endswith("after\n")
    with pytest.raises(ValueError, match="no section marked"):
        pe.write_section(tmp_path / "p.json", text)


def test_trend_says_whether_volatility_rises_with_the_expert_count():
    up = [pe.point_from_rows(e, 8, _rows([v])) for e, v in ((16, 0.01), (64, 0.02), (128, 0.05))]
    assert pe.trend(up).startswith("rises with every step up in the expert count from 16 to 128")
    down = up[:2] + [pe.point_from_rows(128, 8, _rows([0.015]))]
    assert pe.trend(down).startswith("does not rise monotonically")


def test_paper_report_carries_the_section_over(tmp_path):
    from gspo_megatron.experiments.paper_report import EXPERTS_PLACEHOLDER, experts_count

    doc = tmp_path / "paper.md"
    text = pe.section([pe.point_from_rows(16, 8, _rows([0.02]))], SETTING)
    doc.write_text("old\n\n" + text + "\n")
    assert pe.existing_section(doc) == text
    assert experts_count(None, None) == EXPERTS_PLACEHOLDER
    assert pe.existing_section(tmp_path / "missing.md") == pe.empty_section()


SMOKE = """
import subprocess, sys
from pathlib import Path
from gspo_megatron.experiments import paper_experts as pe
out = Path(sys.argv[1])
(out / "doc.md").write_text("# Doc\\n\\n" + pe.empty_section() + "\\n")
sys.exit(subprocess.call([sys.executable, "tools/volatility_vs_experts.py", "--out",
                          str(out / "runs"), "--smoke", "--doc", str(out / "doc.md")]))
"""
AHEAD = {"test_smoke_run_writes_the_section": Command(["{python}", "-c", SMOKE, "{dir}"])}
"""The smoke's training runs (~20 CPU-seconds), in the background while the tests before it run
(``tests/ahead.py``)."""


@pytest.mark.slow
def test_smoke_run_writes_the_section(ahead):
    assert ahead.returncode == 0, ahead.stderr[-3000:]
    text = (ahead.dir / "doc.md").read_text()
    assert "| 8 experts top-2 | 1 |" in text and "| 16 experts top-8 | 1 |" in text
    config = (ahead.dir / "runs" / "e16_top8" / "assets" / "model" / "config.json").read_text()
    assert '"num_experts": 16' in config and '"num_experts_per_tok": 8' in config
    assert not (ahead.dir / "runs" / "e16_top8" / "run" / "checkpoints").exists()  # deleted


def test_render_rewrites_the_section_from_the_saved_points(tmp_path):
    points = [pe.point_from_rows(32, 8, _rows([0.04, 0.06]))]
    pe.save_points(tmp_path / "volatility_vs_experts.json", points, SETTING)
    doc = tmp_path / "doc.md"
    doc.write_text("# Doc\n\n" + pe.empty_section() + "\n")
    assert tool.main(["--out", str(tmp_path), "--render", "--doc", str(doc)]) == 0
    assert "| 32 experts top-8 | 2 | 5.00% (4.00%-6.00%) |" in doc.read_text()

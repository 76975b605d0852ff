"""The paper reproduction: every variant's config validates, the run plan, completed runs are
skipped, the table and figure from synthetic rows, and (slow) the 2-step smoke of the entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.experiments.comparison import across_seeds, comparison_table, plot_comparison
from gspo_megatron.experiments.paper_reproduction import (CONFIG, VARIANTS, RunSpec, Settings,
                                                          cold_start_runs, rl_runs)
from tests.ahead import Command

REPO = Path(__file__).resolve().parents[1]


def test_every_variant_is_a_valid_config_and_starts_from_its_seed_cold_start(tmp_path):
    s = Settings(out=tmp_path, seeds=(1, 2), num_steps=5)
    assets = tmp_path / "assets"
    runs = rl_runs(s, assets)
    assert len(runs) == 2 * len(VARIANTS) and len(cold_start_runs(s, assets)) == 2
    for spec in runs:
        cfg = load_config(CONFIG, spec.overrides)
        seed = cfg.trainer.seed
        assert cfg.model.hf_path == str(tmp_path / "sft" / f"seed{seed}" / "hf_export")
        assert cfg.trainer.num_steps == 5 and cfg.trainer.num_sft_steps == 0
        assert cfg.batch.num_mini_batches == 4 and cfg.model.num_experts == 8
    by_name = {spec.name: load_config(CONFIG, spec.overrides).algo for spec in runs}
    assert by_name["grpo_replay seed 1"].routing_replay == "learner"
    assert by_name["grpo_r3 seed 1"].routing_replay == "rollout"
    assert by_name["grpo seed 1"].routing_replay == "off"
    assert by_name["grpo seed 2"].clip_eps_low == 0.2 and by_name["gspo_learner seed 2"].clip_eps_low == 3e-4
    assert by_name["gspo_engine seed 1"].old_logprob_source == "rollout"


def test_a_run_is_done_only_when_its_last_step_and_export_exist(tmp_path):
    spec = RunSpec("x", tmp_path / "run", last_step=2)
    assert not spec.done()
    spec.run_dir.mkdir()
    (spec.run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
    assert not spec.done()  # no export yet: the run died at the end
    (spec.run_dir / "hf_export").mkdir()
    (spec.run_dir / "hf_export" / "config.json").write_text("{}")
    assert spec.done()


def _rows(acc_end: float, clip: float):
    rows = [{"step": 0, "eval/accuracy": 0.2}]
    rows += [{"step": s, "reward/mean": 0.1 * s, "train/clip_frac_token": clip,
              "routing/activated_expert_changed_frac": 0.05, "time/step_s": 1.0} for s in (1, 2)]
    rows[-1]["eval/accuracy"] = acc_end
    return rows


def test_table_and_figure_from_synthetic_rows(tmp_path):
    runs = {"gspo": {1: _rows(0.6, 0.1), 2: _rows(0.8, 0.2), 3: _rows(0.7, 0.3)},
            "grpo": {1: _rows(0.5, 1e-3)}}
    steps, med, low, high = across_seeds(runs["gspo"], "eval/accuracy")
    assert steps == [0, 2] and med == [0.2, 0.7] and (low[1], high[1]) == (0.6, 0.8)
    table = comparison_table(runs).splitlines()
    assert len(table) == 4 and table[2].startswith("| gspo | 0.700 (0.600-0.800) | 0.700 (0.600-0.800) |")
    assert "| 2.00e-01 |" in table[2] and "| 1.00e-03 |" in table[3]
    png = plot_comparison(runs, tmp_path / "c.png", samples_per_step=256)
    assert png.stat().st_size > 20_000


AHEAD = {"test_smoke_of_the_entry_point": Command(
    ["{python}", "{repo}/tools/reproduce_paper.py", "--out", "{dir}/paper", "--smoke", "--doc",
     "{dir}/paper/doc.md"])}
"""The smoke's 9 training runs (~70 CPU-seconds), in the background while the tests before it
run (``tests/ahead.py``)."""


@pytest.mark.slow
def test_smoke_of_the_entry_point(ahead):
    out = ahead.dir / "paper"
    assert ahead.returncode == 0, ahead.stderr[-3000:]
    doc = (out / "doc.md").read_text()  # 2 steps, nothing clipped: the report still renders
    assert all(f"- `{v}`: end " in doc for v in VARIANTS) and "4. **GSPO can use" in doc
    table = (out / "comparison.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == list(VARIANTS)
    assert (out / "comparison.png").stat().st_size > 20_000
    replay_rows = [json.loads(x) for x in (out / "grpo_replay" / "seed1" / "metrics.jsonl").open()]
    assert [r["step"] for r in replay_rows] == [0, 1, 2]
    assert "routing/expert_set_changed_frac" in replay_rows[-1]
    # Run again: every run is complete, nothing is retrained.
    again = subprocess.run([sys.executable, str(REPO / "tools" / "reproduce_paper.py"),
                            "--out", str(out), "--smoke"], capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and again.stderr.count("already complete") == 1 + len(VARIANTS)

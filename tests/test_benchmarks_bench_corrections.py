"""benchmarks/bench_corrections.py: every setting x column is a config the trainer accepts and
runs the correction it names, a run's row reads its series (None where the run has none), and
the doc section is written between its markers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_corrections as bench
from gspo_megatron.config.load import load_config
from gspo_megatron.config.schema import rollout_staleness

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("setting", list(bench.SETTINGS))
@pytest.mark.parametrize("label, mode, level", bench.COLUMNS)
def test_every_run_is_a_valid_config_with_a_real_mismatch(setting, label, mode, level):
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml",
                      [*bench.bench_async.QUIET, *bench.SETTINGS[setting],
                       "rollout.sglang.port=30000", *bench.column_overrides(mode, level)])
    assert (cfg.algo.tis.mode, cfg.algo.tis.level, cfg.algo.tis.cap) == (mode, level, 2.0)
    assert cfg.model.params_dtype == "fp32" and cfg.algo.old_logprob_source == "learner"
    if setting == "engine":  # on-policy, a bf16 engine
        assert rollout_staleness(cfg.rollout) == 0 and cfg.rollout.embedded_dtype == "bf16"
        assert cfg.rollout.engine == "embedded"
    else:  # k = 4 against a real server serving bf16
        assert rollout_staleness(cfg.rollout) == 4 and cfg.rollout.sglang.dtype == "bfloat16"
        assert cfg.rollout.engine == "sglang"


def _rows(masked=None):
    rows = [{"step": 0, "eval/accuracy": 0.4, "sft/num_steps": 30.0}]
    for step in range(1, 4):
        row = {"step": step, "reward/mean": 0.1 * step, "train/clip_frac_seq": 0.2,
               "train/tis_weight_mean": 1.0, "train/mismatch_kl": 1e-3 * step}
        if masked is not None:
            row["train/tis_masked_frac"] = masked
        rows.append(row)
    rows[-1]["eval/accuracy"] = 0.5
    return rows


def test_a_run_row_reads_its_series_and_leaves_absent_ones_none():
    out = bench.summarise(_rows(masked=0.25))
    assert out["acc_start"] == 0.4 and out["acc_end"] == 0.5
    assert out["mismatch_kl"] == pytest.approx(2e-3) and out["tis_masked_frac"] == 0.25
    assert bench.summarise(_rows())["tis_masked_frac"] is None  # a truncating run: none, not 0
    with pytest.raises(ValueError, match="no GSPO step"):
        bench.summarise([{"step": 0}])


def test_the_doc_section_has_each_column_and_the_spread(tmp_path):
    conditions = {"command": "python benchmarks/bench_corrections.py run", "date": "2026-12-07",
                  "commit": "abc", "cpus": 2, "minutes": 10.0}
    rows = [{"setting": "engine", "column": label, "seed": seed,
             **bench.summarise(_rows(masked=0.1 if mode == "mask" else None)),
             "acc_end": acc}
            for label, mode, _ in bench.COLUMNS for seed, acc in ((1, 0.5), (2, 0.6))]
    doc = tmp_path / "algorithms.md"
    doc.write_text(f"# by hand\n\n{bench.BEGIN}\nstale numbers\n{bench.END}\n\nafter\n")
    text = bench.write_doc(json.loads(json.dumps({"rows": rows, "num_steps": 3, "seeds": [1, 2],
                                                  "conditions": conditions})), doc)
    assert "| engine | mask, token | 50.0% | 60.0% | 55.0% | 50.0-60.0% |" in text
    assert "| engine | none |" in text and "| - | 0.002000 |" in text  # no truncated / masked
    assert "seed 1 40.0%" in text
    page = doc.read_text()
    assert page.startswith("# by hand\n") and page.endswith(f"{bench.END}\n\nafter\n")
    assert "stale numbers" not in page

"""benchmarks/bench_async.py: every column is a config the trainer accepts, the speed row is
computed over the steps after the warm-up, and the doc is written from the results file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_async as bench
from gspo_megatron.config.load import load_config
from gspo_megatron.config.schema import rollout_staleness

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("label, k, corrected", bench.PARITY_COLUMNS)
def test_every_column_is_a_valid_run_against_the_real_server(label, k, corrected):
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml",
                      [*bench.QUIET, *bench.REAL_SERVER, "rollout.sglang.port=30000",
                       *bench.staleness_overrides(k, corrected)])
    assert rollout_staleness(cfg.rollout) == k
    assert cfg.algo.old_logprob_source == "learner"  # equal work: every column recomputes
    assert cfg.algo.tis.mode == ("truncate" if k >= 2 and corrected else "off")


def _row(step, step_s, n=256, length=10.0, **extra):
    return {"step": step, "time/step_s": step_s, "rollout/num_sequences": n,
            "rollout/response_len_mean": length, "rollout/response_len_max": 3 * length, **extra}


def test_speed_row_skips_the_warm_up_steps():
    rows = [{"step": 0}, _row(1, 100.0), _row(2, 100.0), _row(3, 2.0, length=5.0),
            _row(4, 2.0, length=15.0, **{"async/dropped_stale_groups": 2.0})]
    out = bench.speed_row(rows, warmup=2)
    assert out["steps"] == 2 and out["seconds"] == 4.0 and out["steps_per_s"] == 0.5
    assert out["tokens_per_s"] == pytest.approx(256 * 20 / 4.0)
    assert out["response_len_max"] == 45.0 and out["dropped_stale"] == 2.0
    with pytest.raises(ValueError, match="no step after the 4 warm-up steps"):
        bench.speed_row(rows, warmup=4)


def test_the_doc_has_the_ratio_to_on_policy_and_the_spread_over_seeds(tmp_path):
    conditions = {"command": "python benchmarks/bench_async.py speed", "date": "2026-12-06",
                  "commit": "abc", "cpus": 2, "load_start": 1.0, "load_end": 2.0, "minutes": 3.0,
                  "threads": "1"}
    rows = [{"workload": "longtail", "k": k, **bench.speed_row(
        [_row(1, 1.0), _row(2, s), _row(3, s)], warmup=1)} for k, s in ((0, 4.0), (2, 2.0))]
    parity = [{"column": label, "seed": seed, "acc_start": 0.3, "acc_end": acc,
               "reward_last10": 0.5, "clip_frac_seq": 0.1, "tis_weight_mean": 1.0}
              for label, _, _ in bench.PARITY_COLUMNS for seed, acc in ((1, 0.5), (2, 0.7))]
    results = {"speed": {"rows": rows, "num_steps": 3, "warmup_steps": 1, "conditions": conditions},
               "parity": {"rows": parity, "num_steps": 40, "seeds": [1, 2],
                          "conditions": conditions}}
    doc = tmp_path / "doc.md"
    doc.write_text(f"# design\n\nby hand\n\n{bench.BEGIN}\nold numbers\n{bench.END}\n\nafter\n")
    text = bench.write_doc(json.loads(json.dumps(results)), doc)
    assert "| longtail | 2 | 0.500 | 2.00x |" in text
    assert "| k=4, no behaviour weight | 50.0% | 70.0% | 60.0% | 50.0-70.0% |" in text
    page = doc.read_text()
    assert page.startswith("# design\n\nby hand\n") and page.endswith(f"{bench.END}\n\nafter\n")
    assert text in page and "old numbers" not in page
    (tmp_path / "bare.md").write_text("no markers\n")
    with pytest.raises(ValueError, match="lacks the markers"):
        bench.write_doc(results, tmp_path / "bare.md")


def test_the_lengths_section_compares_k4_with_on_policy_per_answer_length(tmp_path):
    """The trained prompts come from the ledger at k >= 2 (taken, and left at the end) and from
    the data order on-policy; the row divides the response length by the trained answers'."""
    answer_len = {"a": 3, "b": 11, "c": 41}
    run = tmp_path / "run"
    run.mkdir()
    (run / "async_groups.jsonl").write_text(
        json.dumps({"step": 1, "taken": [[0, "a", 0, {"5": 8}], [1, "b", 1, {"5": 40}]]}) + "\n"
        + json.dumps({"step": 2, "dropped": [[3, "b", "equal_rewards"]]}) + "\n"
        + json.dumps({"step": 2, "left": [[2, "c"]]}) + "\n")
    assert bench.trained_prompts(run, 4, ["c", "b", "a"], 1, 2) == (["a", "b"], ["c"])
    assert bench.trained_prompts(run, 0, ["c", "b", "a"], 1, 2) == (["c", "b"], [])
    rows = [{"step": 0}, {"step": 1, "rollout/response_len_mean": 8.0,
                          "async/dropped_stale_groups": 1.0, "async/lag_mean": 0.5},
            {"step": 2, "rollout/response_len_mean": 6.0}]
    row = bench.length_row(rows, 4, 1, ["a", "b"], ["c"], answer_len)
    assert row["answer_len_mean"] == 7.0 and row["response_per_answer"] == 1.0
    assert (row["left_groups"], row["left_answer_len_mean"], row["dropped_stale"]) == (1, 41, 1.0)

    conditions = {"command": "python benchmarks/bench_async.py lengths", "date": "2026-12-07",
                  "commit": "abc", "cpus": 2, "load_start": 1.0, "load_end": 2.0, "minutes": 3.0,
                  "threads": "1"}
    other = dict(row, seed=2, response_len_mean=9.0, response_per_answer=9.0 / 7.0)
    on_policy = dict(row, k=0, left_groups=0, left_answer_len_mean=None, dropped_stale=0.0)
    doc = tmp_path / "doc.md"
    doc.write_text(f"{bench.BEGIN}\n{bench.END}\n")
    text = bench.write_doc({"lengths": {"rows": [on_policy, row, other], "num_steps": 2,
                                        "seeds": [1, 2], "conditions": conditions}}, doc)
    assert "| 4 | 7.00 / 9.00 | 8.00 (7.00-9.00) | 7.00 | 1.143 (1.000-1.286) | 1, 41.00 | 2 |" in text
    assert "| 0 | 7.00 | 7.00 (7.00-7.00) | 7.00 | 1.000 (1.000-1.000) | 0 | 0 |" in text
    for k in bench.LENGTH_KS:  # each column is a run the trainer accepts
        cfg = load_config(REPO / "configs" / "tiny_longtail.yaml",
                          [*bench.QUIET, *bench.REAL_SERVER, "rollout.sglang.port=30000",
                           *bench.staleness_overrides(k)])
        assert rollout_staleness(cfg.rollout) == k and cfg.data.shuffle is False

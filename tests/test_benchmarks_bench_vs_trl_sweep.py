"""benchmarks/bench_vs_trl_sweep.py: each side's thread candidates are valid runs of the stated
setting, the table sorts and ranges the ratios, the doc section is replaced between its markers,
and a probe run past its time is stopped with its process group."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import bench_vs_trl_sweep as sweep, vs_trl_setup
from gspo_megatron.config.load import load_config
from gspo_megatron.trainer.schedule.one_step_threads import probe_phases


def _config(overrides, steps=6):
    args = SimpleNamespace(steps=steps, prompts=16, samples=8, max_new_tokens=48,
                           with_diagnostics=False)
    cmd = vs_trl_setup.gspo_command(args, Path("/assets"), Path("/run"),
                                    [*vs_trl_setup.GSPO_SIDES["gspo_overlap"], *overrides])
    return load_config(cmd[3], cmd[4:])


def test_candidates_are_the_thread_settings_the_machine_allows():
    assert [c.threads for c in sweep.candidates("trl", 2)] == [1, 2]
    assert [c.label for c in sweep.candidates("gspo", 2)] == ["1 thread", "2 threads"]
    overlap = sweep.candidates("gspo_overlap", 2)
    assert [c.label for c in overlap] == ["learner 1 + engine 1", "learner 2 + engine 1"]
    assert {c.threads for c in overlap} == {2}  # the process gets the whole machine
    assert len(sweep.candidates("gspo_overlap", 1)) == 1  # both splits are one thread there


def test_overlap_candidates_fix_the_split_and_never_time_the_trainers_probe():
    for c, split in zip(sweep.candidates("gspo_overlap", 2), ("share", "full")):
        cfg = _config(c.overrides)
        assert cfg.rollout.overlap_one_step and cfg.rollout.overlap_thread_split == split
        assert cfg.rollout.overlap_probe_steps == 0 and cfg.rollout.embedded_num_threads == 1


def test_the_auto_run_is_long_enough_to_probe_every_phase(monkeypatch):
    seen = {}

    def fake_run_side(side, args, assets, run_dir, trl, index, threads, overrides):
        seen.update(steps=args.steps, overrides=overrides, threads=threads)
        return {"step_s_median": 0.1, "step_s_all": [2.0] * (args.steps - 2) + [0.5, 0.3]}

    monkeypatch.setattr(sweep.bench, "run_side", fake_run_side)
    args = SimpleNamespace(steps=6, with_diagnostics=False)
    res = sweep.run_auto(sweep.SHAPES["base"], args, Path("/a"), Path("/r"), num_cpus=2)
    # steady state: the steps after the warm-up and the probe; the first-N mean has them all
    assert res["probe_steps"] == seen["steps"] - 2 and res["steady_s"] == 0.4
    assert res["first_n_mean_s"] == pytest.approx((2.0 * (seen["steps"] - 2) + 0.8) / seen["steps"])
    cfg = _config(list(seen["overrides"]), steps=seen["steps"])
    assert cfg.rollout.overlap_thread_split == "auto" and seen["threads"] == 2
    num_phases = len(probe_phases("auto", 2, 1))
    assert 1 + num_phases * cfg.rollout.overlap_probe_steps < cfg.trainer.num_steps


def test_every_shape_writes_a_model_of_its_own_sizes(tmp_path):
    shape = sweep.SHAPES["wide"]
    assert (shape.hidden_size, shape.num_experts, shape.top_k) == (256, 16, 4)
    vs_trl_setup.make_assets(tmp_path, shape.hidden_size, shape.num_experts, shape.top_k)


    hf = json.loads((tmp_path / "model" / "config.json").read_text())
    assert (hf["hidden_size"], hf["num_experts"], hf["num_experts_per_tok"]) == (256, 16, 4)
    assert len({(s.hidden_size, s.num_experts, s.top_k, s.prompts, s.max_new_tokens)
                for s in sweep.SHAPES.values()}) == len(sweep.SHAPES) >= 4


def _row(name, trl, gspo, overlap, auto=None):
    return {"shape": asdict(sweep.SHAPES[name]), "step_s": {"trl": trl, "gspo": gspo,
                                                              "gspo_overlap": overlap},
            "setting": {"trl": "1 thread", "gspo": "2 threads",
                        "gspo_overlap": "learner 1 + engine 1"}, "auto": auto or {},
            "probe": {"trl": {"1 thread": trl, "2 threads": float("inf")},
                      "gspo": {"1 thread": gspo}, "gspo_overlap": {"x": overlap}}}


def test_table_puts_the_best_shape_first_and_gives_the_range():
    rows = [_row("wide", 1.0, 0.7, 1.05, {"overlap/probe_share_step_s": 1.1,
                                          "overlap/probe_serial_share_step_s": 0.8,
                                          "warned": True}),
            _row("base", 0.6, 0.4, 0.25)]
    text = sweep.table(rows, ["trl", "gspo", "gspo_overlap"])
    lines = text.splitlines()
    assert lines[2].startswith("| base |") and lines[3].startswith("| wide |")
    assert "**2.40x**" in lines[2] and "**0.95x**" in lines[3]  # TRL's time over ours
    assert "| 2 threads, 0.700 |" in lines[3]
    assert "warned" in lines[3] and "kept `share`" in lines[3]
    assert "- on-policy: **1.43x - 1.50x**" in text and "- overlap: **0.95x - 2.40x**" in text
    assert text.rstrip().endswith("overlap slower than on-policy at: wide")
    assert "2 threads: stopped" in sweep.probe_table(rows, ["trl", "gspo", "gspo_overlap"])


def test_doc_section_is_replaced_between_its_markers(tmp_path):
    doc = tmp_path / "perf.md"
    doc.write_text(f"# head\n{sweep.MARK_BEGIN}\nold numbers\n{sweep.MARK_END}\ntail\n")
    sweep.write_doc(doc, f"{sweep.MARK_BEGIN}\nnew\n{sweep.MARK_END}")
    assert doc.read_text() == f"# head\n{sweep.MARK_BEGIN}\nnew\n{sweep.MARK_END}\ntail\n"
    (tmp_path / "bare.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="no section marked"):
        sweep.write_doc(tmp_path / "bare.md", "x")


def test_probe_timeout_follows_the_quickest_run():
    assert sweep.probe_timeout(float("inf")) is None  # nothing to compare with yet
    assert sweep.probe_timeout(10.0) == sweep.PROBE_TIMEOUT_FACTOR * 10.0 + 20


def test_a_run_past_its_time_is_stopped_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); open(sys.argv[1], 'w').write(str(p.pid)); "
            "time.sleep(60)")
    start = time.monotonic()
    assert vs_trl_setup._run([sys.executable, "-c", code, str(pid_file)], dict(os.environ),
                             timeout_s=8) is None
    assert time.monotonic() - start < 40
    child = int(pid_file.read_text())
    for _ in range(50):  # killed; reaped by init shortly after
        stat = Path(f"/proc/{child}/stat")
        if not stat.exists() or stat.read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the grandchild {child} outlived the stopped run")
    done = vs_trl_setup._run([sys.executable, "-c", "print('ok')"], dict(os.environ), 30)
    assert done.returncode == 0 and done.stdout.strip() == "ok"


def _record(rows):
    return {"args": {"steps": 6, "rounds": 3, "with_diagnostics": False, "sides":
                     "trl,gspo,gspo_overlap", "shapes": None, "doc": "docs/performance.md"},
            "sides": ["trl", "gspo", "gspo_overlap"], "rows": rows, "wall_s": 600.0,
            "started": "2026-12-05 04:19", "num_cpus": 2}


def test_readme_headline_quotes_the_range_and_its_conditions(tmp_path):
    rows = [_row("wide", 1.0, 0.7, 1.05), _row("base", 0.6, 0.4, 0.25)]
    for r, load in zip(rows, ([3.0, 4.0], [5.0, 6.5])):
        r["load"] = load
    text = sweep.headline(_record(rows))
    assert text.startswith(sweep.HEADLINE_BEGIN) and text.endswith(sweep.HEADLINE_END)
    assert "over 2 shapes" in text and "hidden 128-256" in text
    assert "8-16 experts, top-k 2-4" in text
    assert "on-policy with the engine's log-probs (`algo.old_logprob_source=rollout`" in text
    assert "on-policy with the engine's log-probs (`algo.old_logprob_source=rollout`, no extra " \
        "forward pass) **1.43-1.50x**" in text and "**0.95-2.40x**" in text
    assert "8-16 prompts x 8 samples" in text and "TRL recomputes its old log-probs" in text
    assert "own best thread setting" in text and "diagnostic off" in text
    assert "2 CPUs, load average 3.0 at the start and 6.5 at the end" in text
    assert "slower than on-policy at 1 of 2 shapes (wide)" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{sweep.HEADLINE_BEGIN}\nold\n{sweep.HEADLINE_END}\nb\n")
    doc = tmp_path / "perf.md"
    doc.write_text(f"{sweep.MARK_BEGIN}{sweep.MARK_END}")
    sweep.render(_record(rows), str(doc), str(readme))
    assert readme.read_text() == f"a\n{text}\nb\n"
    written = doc.read_text()
    # a record without argv: the flags that differ from the defaults (three of the four sides)
    assert ("python benchmarks/bench_vs_trl.py --sweep --sides trl,gspo,gspo_overlap "
            "--doc docs/performance.md") in written
    assert "whole sweep 10.0 min" in written and "| base |" in written


def test_the_learner_log_prob_side_is_the_equal_work_column():
    """Issue 41 item 6: the sweep's default sides put both pi_old sources next to TRL, and the
    learner side differs from the engine side only in that source."""
    assert sweep.DEFAULTS["sides"].split(",") == ["trl", "gspo", "gspo_learner_lp", "gspo_overlap"]
    engine = _config([])  # through the overlap side's flags; compare the sources alone
    args = SimpleNamespace(steps=6, prompts=16, samples=8, max_new_tokens=48, with_diagnostics=False)
    cmd = vs_trl_setup.gspo_command(args, Path("/a"), Path("/r"),
                                    vs_trl_setup.GSPO_SIDES["gspo_learner_lp"])
    learner = load_config(cmd[3], cmd[4:])
    assert engine.algo.old_logprob_source == "rollout" and learner.algo.old_logprob_source == "learner"
    assert not learner.rollout.overlap_one_step
    rows = [_row("base", 0.6, 0.4, 0.25)]
    rows[0]["step_s"]["gspo_learner_lp"] = 0.5
    rows[0]["setting"]["gspo_learner_lp"] = "2 threads"
    rows[0]["first_n_s"] = {"trl": 0.9, "gspo": 0.6, "gspo_learner_lp": 0.75, "gspo_overlap": 0.45}
    rows[0]["auto"] = {"steady_s": 0.3, "first_n_mean_s": 0.7, "probe_steps": 5,
                       "step_s_all": [0.7] * 7}
    sides = sweep.DEFAULTS["sides"].split(",")
    text = sweep.table(rows, sides)
    assert "on-policy, learner log-probs vs TRL" in text and "**1.20x**" in text  # 0.6 / 0.5
    first = sweep.first_steps_table(rows, sides).splitlines()[2]
    assert "| 0.500 / 0.750 |" in first and "| 1.20x |" in first  # TRL 0.9 / ours 0.75
    assert first.endswith("| 0.300 / 0.700 (5 of 7) |")


def test_a_record_without_the_measuring_runs_conditions_is_refused(tmp_path):
    record = _record([_row("base", 0.6, 0.4, 0.25)])
    record["rows"][0]["load"] = [1.0, 1.0]
    good = tmp_path / "results.json"
    good.write_text(json.dumps(record))
    assert sweep.load_record(good)["num_cpus"] == 2
    del record["num_cpus"], record["started"]
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps(record))
    with pytest.raises(SystemExit, match=r"old.json: the record has no \['started', 'num_cpus'\]"):
        sweep.load_record(bad)
    (tmp_path / "torn.json").write_text("{")
    with pytest.raises(SystemExit, match="torn.json: cannot read"):
        sweep.load_record(tmp_path / "torn.json")


def test_the_headline_cites_the_committed_record():
    record = _record([_row("base", 0.6, 0.4, 0.25)])
    record["rows"][0]["load"] = [1.0, 1.0]
    record["results_path"] = "benchmarks/results/vs_trl_sweep.json"
    assert "from [benchmarks/results/vs_trl_sweep.json](benchmarks/results/vs_trl_sweep.json)" \
        in sweep.headline(record)


def test_the_committed_headline_and_section_are_what_the_committed_record_renders():
    """Issue 41 item 6: the README's speed line and docs/performance.md's sweep section come
    from ``benchmarks/results/vs_trl_sweep.json`` as committed: a hand edit of either, or a
    record committed without rendering it, fails here."""
    repo = Path(__file__).resolve().parents[1]
    record = sweep.load_record(repo / "benchmarks" / "results" / "vs_trl_sweep.json")
    readme, doc = (repo / "README.md").read_text(), (repo / "docs" / "performance.md").read_text()
    assert sweep.headline(record) in readme, "README: rerun bench_vs_trl.py --sweep --from-results"
    assert sweep.section(record) in doc, "docs/performance.md: rerun ... --from-results"
    assert "old_logprob_source=learner" in sweep.headline(record)  # the equal-work column is in it

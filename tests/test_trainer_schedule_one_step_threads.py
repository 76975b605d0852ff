"""The learner's threads beside the engine's process (trainer/schedule/one_step_threads.py): which split
each phase uses, which one the probe keeps, the warning when the overlap does not pay, and a
real overlapped run that probes, waits in its serial steps and logs what it decided."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_megatron.trainer.schedule.one_step_threads import OverlapThreadTuner, learner_threads, probe_phases

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _drive(tuner, times, first=1):
    """Run steps ``first ..`` with the given step time per phase (a number, or a list taken in
    turn); the threads and waits seen."""
    seen, out = [], {}
    for step in range(first, tuner.num_steps + 1):
        serial = tuner.before_update(step)
        phase = tuner.phase(step)
        seen.append((step, torch.get_num_threads(), serial))
        t = times.get(phase, 0.1)
        t = t.pop(0) if isinstance(t, list) else t
        out = {**out, **tuner.after_step(step, {"time/step_s": t})}
    return seen, out


def test_splits_give_the_learner_the_machine_or_what_the_engine_leaves():
    assert learner_threads("share", 2, 1) == 1 and learner_threads("full", 2, 1) == 2
    assert learner_threads("share", 1, 1) == 1  # at least one stays
    assert learner_threads("share", 8, 3) == 5
    assert probe_phases("auto", 2, 1) == ["share", "full", "serial_share", "serial_full"]
    assert probe_phases("auto", 1, 1) == ["share", "serial_share"]  # both are one thread
    assert probe_phases("full", 2, 1) == ["full", "serial_share", "serial_full"]


def test_auto_probes_the_phases_in_turns_and_keeps_the_faster_split(caplog):
    tuner = OverlapThreadTuner("auto", 2, 1, probe_steps=2, num_steps=11)
    with caplog.at_level(logging.INFO):
        seen, out = _drive(tuner, {"share": 0.5, "full": 0.3, "serial_share": 0.45,
                                   "serial_full": 0.4})
    # 1 warm-up (share); 2-5 and 6-9: share, full, serial 1 thread, serial 2; then full
    assert [t for _, t, _ in seen] == [1, 1, 2, 1, 2, 1, 2, 1, 2, 2, 2]
    assert [s for _, _, s in seen] == [False] + [False, False, True, True] * 2 + [False] * 2
    assert tuner.chosen == "full"
    assert out["overlap/probe_share_step_s"] == 0.5
    assert out["overlap/probe_serial_full_step_s"] == 0.4
    assert out["overlap/pays"] == 1.0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_warns_with_the_numbers_when_overlapping_is_slower_than_serial(caplog):
    tuner = OverlapThreadTuner("auto", 2, 1, probe_steps=2, num_steps=10)
    with caplog.at_level(logging.INFO):
        seen, out = _drive(tuner, {"share": 0.63, "full": 0.7, "serial_share": 0.43,
                                   "serial_full": 0.8})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "0.630 s (split 'share')" in warnings[0]
    assert "0.430 s with 1 learner thread(s)" in warnings[0]
    assert "rollout.overlap_one_step=false (OMP_NUM_THREADS=1)" in warnings[0]
    assert tuner.chosen == "share" and out["overlap/pays"] == 0.0
    assert seen[-1][1] == 1  # the rest of the run with the kept split


def test_a_slow_first_round_does_not_decide():
    """Each phase counts its fastest step: a warm-up or a busy moment in one round is not
    taken for the phase's speed (the median of two steps would have warned here)."""
    tuner = OverlapThreadTuner("auto", 2, 1, probe_steps=2, num_steps=11)
    seen, out = _drive(tuner, {"share": [0.9, 0.3], "full": [0.55, 0.5],
                               "serial_share": [0.4, 0.45], "serial_full": [0.5, 0.42]})
    assert out["overlap/probe_share_step_s"] == 0.3 and tuner.chosen == "share"
    assert out["overlap/probe_serial_share_step_s"] == 0.4 and out["overlap/pays"] == 1.0


def test_a_hopeless_phase_leaves_the_later_rounds(caplog):
    tuner = OverlapThreadTuner("auto", 2, 1, probe_steps=3, num_steps=14)
    with caplog.at_level(logging.INFO):
        seen, out = _drive(tuner, {"share": 0.3, "full": 10.0, "serial_share": 0.5,
                                   "serial_full": 5.0})
    # round 1: 2 share, 3 full (over 2x share: dropped), 4 serial 1 thread, 5 serial 2 threads
    # (dropped); rounds 2 and 3: share, serial 1 thread; then share for the rest
    assert [s for _, _, s in seen] == [False, False, False, True, True, False, True, False,
                                       True] + [False] * 5
    assert tuner.step_s["full"] == [10.0] and tuner.step_s["serial_full"] == [5.0]
    assert len(tuner.step_s["serial_share"]) == 3 and len(tuner.step_s["share"]) == 3
    assert tuner.chosen == "share" and out["overlap/pays"] == 1.0
    assert sum("not probed further" in r.getMessage() for r in caplog.records) == 2


def test_a_fixed_split_still_checks_against_serial(caplog):
    tuner = OverlapThreadTuner("full", 2, 1, probe_steps=1, num_steps=6)
    with caplog.at_level(logging.WARNING):
        seen, out = _drive(tuner, {"full": 0.9, "serial_share": 0.5, "serial_full": 0.6})
    assert [t for _, t, _ in seen] == [2, 2, 1, 2, 2, 2]
    assert [s for _, _, s in seen] == [False, False, True, True, False, False]
    assert out["overlap/pays"] == 0.0 and "overlap/probe_share_step_s" not in out
    assert len(caplog.records) == 1 and "OMP_NUM_THREADS=1" in caplog.records[0].getMessage()


@pytest.mark.parametrize("num_steps,probe_steps", [(9, 2), (11, 0)])
def test_short_runs_and_probe_off_keep_share_without_probing(num_steps, probe_steps, caplog):
    tuner = OverlapThreadTuner("auto", 2, 1, probe_steps=probe_steps, num_steps=num_steps)
    with caplog.at_level(logging.WARNING):
        seen, out = _drive(tuner, {"share": 5.0})
    assert {t for _, t, _ in seen} == {1} and not any(s for _, _, s in seen)
    assert set(out) == {"overlap/learner_threads"} and not caplog.records


def test_a_resumed_run_probes_from_its_own_first_step():
    tuner = OverlapThreadTuner("auto", 2, 1, probe_steps=1, num_steps=60)
    seen, out = _drive(tuner, {"share": 0.2, "full": 0.3, "serial_share": 0.4,
                               "serial_full": 0.4}, first=51)
    assert [s for _, _, s in seen][:6] == [False, False, False, True, True, False]
    assert out["overlap/pays"] == 1.0 and tuner.chosen == "share"


def test_real_overlapped_run_probes_and_logs_its_choice(tmp_path):
    """gspo-train with two threads, the overlap and ``auto``: steps 2 / 3 / 4 / 5 run share /
    full / serial with 1 thread / serial with 2, step 5 logs the probe, every step the learner's
    threads (a phase may be cut short, never reordered)."""
    from gspo_megatron.tiny_task.assets import make_tiny_assets
    from gspo_megatron.tiny_task.task import AdditionTaskConfig

    assets = make_tiny_assets(tmp_path / "assets", task=AdditionTaskConfig(num_train=200,
                                                                           num_eval=16))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "gspo_megatron.cli.train", str(REPO / "configs" / "tiny_cpu.yaml"),
           f"model.hf_path={assets.model_dir}", f"data.train_path={assets.train_path}",
           "data.eval_path=null", f"logging.run_dir={run_dir}", "logging.wandb.enabled=false",
           "logging.plot=false", "batch.num_prompts_per_step=4", "rollout.n_samples_per_prompt=4",
           "batch.num_mini_batches=2", "trainer.num_sft_steps=0", "trainer.eval_every_steps=0",
           "checkpoint.save_every_steps=0", "trainer.num_steps=6", "rollout.overlap_one_step=true",
           "rollout.overlap_thread_split=auto", "rollout.overlap_probe_steps=1"]
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = {r["step"]: r for r in rows if r["step"] >= 1}
    threads = [rows[s]["overlap/learner_threads"] for s in (1, 2, 3, 4, 5)]
    assert threads == [1.0, 1.0, 2.0, 1.0, 2.0]
    probe = {k: v for k, v in rows[5].items() if k.startswith("overlap/probe_")}
    phases = ("share", "full", "serial_share", "serial_full")
    assert set(probe) == {f"overlap/probe_{p}_step_s" for p in phases}
    assert probe["overlap/probe_serial_full_step_s"] == rows[5]["time/step_s"]
    assert probe["overlap/probe_share_step_s"] == rows[2]["time/step_s"]
    overlapped = min(probe["overlap/probe_share_step_s"], probe["overlap/probe_full_step_s"])
    serial = min(probe["overlap/probe_serial_share_step_s"],
                 probe["overlap/probe_serial_full_step_s"])
    pays = overlapped <= serial
    assert rows[5]["overlap/pays"] == float(pays)
    assert ("does not pay here" in proc.stderr) == (not pays)
    assert "overlap probe (fastest s per step" in proc.stderr

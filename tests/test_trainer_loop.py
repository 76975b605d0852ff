"""The GSPO loop end to end on the tiny config: a few steps in one process and on two gloo
processes (TP=2 and EP=2), both old-log-prob sources, GSPO and GRPO; and kill -9 + resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.descriptors import listening_sockets
from tests.multiproc import run_on_ranks

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from gspo_megatron.tiny_task.assets import make_tiny_assets
    from gspo_megatron.tiny_task.task import AdditionTaskConfig

    out = tmp_path_factory.mktemp("tiny_assets")
    return make_tiny_assets(out, task=AdditionTaskConfig(num_train=200, num_eval=16))


def _overrides(assets, run_dir: Path, *extra: str):
    return [f"model.hf_path={assets.model_dir}", f"data.train_path={assets.train_path}",
            f"data.eval_path={assets.eval_path}", f"logging.run_dir={run_dir}",
            "logging.wandb.enabled=false", "logging.plot=true", "batch.num_prompts_per_step=4",
            "rollout.n_samples_per_prompt=4", "batch.num_mini_batches=2", "trainer.num_sft_steps=2",
            "trainer.sft_batch_size=8", "trainer.eval_every_steps=0", "checkpoint.save_every_steps=0",
            *extra]


def _train(rank: int, overrides) -> dict:
    from gspo_megatron.cli.train import main

    code = main([str(REPO / "configs" / "tiny_cpu.yaml"), *overrides])
    return {"code": code}


def _rows(run_dir: Path):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _check_run(run_dir: Path, num_steps: int, first_synced_step: int = 1) -> list:
    """Every step syncs weights; with the overlap, step 1 trains on the weights synced before
    it and step k >= 2 syncs those of step k - 1 before submitting the next rollout."""
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(num_steps + 1))
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    for row in rows[1:]:
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert 0.0 <= row["train/clip_frac_token"] <= 1.0 and row["train/grad_norm"] >= 0.0
    for row in rows[first_synced_step:]:
        assert row["weight_sync/gb"] > 0
        # Expert volatility (the tiny model is MoE) and the per-length diagnostics.
        assert 0.0 <= row["routing/activated_expert_changed_frac"] <= \
            row["routing/expert_set_changed_frac"] <= 1.0
        buckets = [k for k in row if k.startswith("train/len_") and k.endswith("/seq_frac")]
        assert buckets and sum(row[k] for k in buckets) == pytest.approx(1.0)
    assert (run_dir / "config.yaml").is_file() and (run_dir / "metrics.png").is_file()
    assert (run_dir / "hf_export" / "config.json").is_file()
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("algo, source", [("gspo", "learner"), ("gspo", "rollout"),
                                          ("grpo", "learner")])
def test_loop_single_process(assets, tmp_path, algo, source):
    extra = [f"algo.loss={algo}", f"algo.old_logprob_source={source}", "trainer.num_steps=2"]
    if algo == "grpo":
        extra += ["algo.clip_eps_low=0.2", "algo.clip_eps_high=0.27"]
    assert _train(0, _overrides(assets, tmp_path, *extra))["code"] == 0
    rows = _check_run(tmp_path, 2)
    if source == "learner":  # learner and engine compute the same policy's log-probs
        assert rows[2]["rollout/learner_vs_engine_abs_logp"] < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("layout, algo, source", [
    (["parallel.tp=2", "parallel.sp=true", "algo.routing_replay=rollout"], "gspo", "learner"),
    (["parallel.ep=2", "algo.tis.mode=truncate", "algo.routing_replay=learner"], "grpo", "learner"),
], ids=["tp2_sp_gspo_learner_r3", "ep2_grpo_learner_tis_routing_replay"])
def test_loop_two_gloo_ranks(assets, tmp_path, layout, algo, source):
    extra = [*layout, f"algo.loss={algo}", f"algo.old_logprob_source={source}", "trainer.num_steps=2"]
    if algo == "grpo":
        extra += ["algo.clip_eps_low=0.2", "algo.clip_eps_high=0.27"]
    results = run_on_ranks(_train, world_size=2, timeout_s=600,
                           overrides=_overrides(assets, tmp_path, *extra))
    assert [r["code"] for r in results] == [0, 0]
    rows = _check_run(tmp_path, 2)
    # Step 2 samples come from the engine after one sharded update and weight sync: the engine's
    # log-probs must equal the sharded learner's recomputation of the same tokens.
    assert rows[2]["rollout/learner_vs_engine_abs_logp"] < 1e-4


@pytest.mark.slow
def test_a_mask_that_drops_every_sequence_skips_the_update_and_counts_it(assets, tmp_path):
    """Issue 51, bad input: ``algo.tis.mode=mask`` with a band so narrow that every sequence of
    a bf16 engine (a real mismatch with the fp32 learner) falls outside it. Each mini-batch's
    update is skipped and counted (``train/masked_out_mini_batches``), not trained on a zero
    gradient nor turned into a NaN: without SFT steps the learner never steps, so the exported
    policy is the initial one, bit for bit."""
    extra = ["algo.old_logprob_source=learner", "algo.tis.mode=mask", "algo.tis.level=sequence",
             "algo.tis.cap=1.0000001", "rollout.embedded_dtype=bf16", "trainer.num_sft_steps=0",
             "trainer.num_steps=2", "logging.plot=false"]
    assert _train(0, _overrides(assets, tmp_path, *extra))["code"] == 0
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["train/masked_out_mini_batches"] == 2.0  # batch.num_mini_batches=2
        assert not any(k.startswith("train/") and k != "train/masked_out_mini_batches"
                       for k in row)
        assert all(v == v for v in row.values() if isinstance(v, float))  # no NaN anywhere
    saved = (tmp_path / "config.yaml").read_text()
    assert "mode: mask" in saved and "cap: 1.0000001" in saved
    from safetensors.torch import load_file

    start = load_file(str(assets.model_dir / "model.safetensors"))
    (exported,) = [load_file(str(f)) for f in (tmp_path / "hf_export").glob("*.safetensors")]
    assert exported.keys() == start.keys()
    for name, weight in exported.items():  # no optimizer step moved a weight
        assert torch.equal(weight, start[name].to(weight.dtype)), name


@pytest.mark.slow
def test_overlap_trains_one_step_off_policy(assets, tmp_path):
    """Step k+1 is generated while step k trains: from step 2 on the samples are one update old.
    The learner recomputes their log-probs under the generating weights (equal to the engine's),
    and the ratio of the first (here: only) mini-batch shows the one-step policy change."""
    extra = ["rollout.overlap_one_step=true", "algo.old_logprob_source=learner",
             "algo.tis.mode=truncate", "algo.tis.level=token", "batch.num_mini_batches=1",
             "algo.entropy_coef=0.1",
             "optimizer.lr=0.01", "optimizer.warmup_steps=0", "trainer.num_steps=3",
             "trainer.eval_every_steps=2"]
    assert _train(0, _overrides(assets, tmp_path, *extra))["code"] == 0
    rows = _check_run(tmp_path, 3, first_synced_step=2)
    assert [r["rollout/policy_lag_steps"] for r in rows[1:]] == [0.0, 1.0, 1.0]
    for row in rows[1:]:
        assert row["rollout/learner_vs_engine_abs_logp"] < 1e-4
    spread = [r["train/ratio_max"] - r["train/ratio_min"] for r in rows[1:]]
    assert spread[0] < 1e-4 and min(spread[1:]) > 1e-3, spread
    assert "eval/accuracy" in rows[2]


@pytest.mark.slow
def test_max_staleness_0_and_1_are_the_on_policy_and_one_step_runs(assets, tmp_path):
    """Issue 40: ``rollout.max_staleness=0`` is the on-policy run and ``1`` the one-step
    off-policy run of ``overlap_one_step``, loss for loss, seed for seed (the embedded engine is
    deterministic, so any other path would show)."""
    base = ["algo.old_logprob_source=learner", "trainer.num_steps=3", "logging.plot=false"]
    runs, listening = {}, [listening_sockets()]
    for name, extra in (("default", []), ("k0", ["rollout.max_staleness=0"]),
                        ("overlap", ["rollout.overlap_one_step=true"]),
                        ("k1", ["rollout.max_staleness=1"])):
        assert _train(0, _overrides(assets, tmp_path / name, *base, *extra))["code"] == 0
        listening.append(listening_sockets())
        runs[name] = [{k: v for k, v in r.items() if (k.startswith(("train/", "reward/", "eval/"))
                       or k == "rollout/policy_lag_steps") and not k.endswith(("_s", "per_s"))}
                      for r in _rows(tmp_path / name)]  # every value but the clocks'
    assert "train/pg_loss" in runs["k0"][1] and "train/loss" in runs["k0"][1]
    assert runs["default"] == runs["k0"]
    assert runs["overlap"] == runs["k1"]
    assert [r["rollout/policy_lag_steps"] for r in runs["k1"][1:]] == [0.0, 1.0, 1.0]
    assert runs["k0"] != runs["k1"]  # the two modes do differ: the comparison could fail
    # Four runs in this process leave no gloo group behind (each one's listening socket): a
    # run's model, optimizer and groups are freed when it ends (learner/release.py,
    # distributed/startup_gc.thaw_start_up); 18 more per run before.
    assert listening == [listening[0]] * 5


@pytest.mark.slow
def test_max_staleness_2_on_two_gloo_ranks_with_a_reference_server(assets, tmp_path):
    """k = 2 with a TP=2 learner: the main rank's generator feeds both ranks (broadcast), the
    proximal pass and the update are collective, a checkpoint holds the main rank's state on
    every rank, and no step trains a token more than 2 steps after its weights. ``algo.tis`` is
    left at its default: at k = 2 that is the sequence-level behaviour weight (issue 51)."""
    from gspo_megatron.distributed.ports import free_port

    extra = ["parallel.tp=2", "parallel.sp=true", "algo.old_logprob_source=learner",
             "trainer.num_steps=4",
             "rollout.engine=reference", "rollout.mode=disaggregated", "rollout.max_staleness=2",
             f"rollout.sglang.port={free_port()}", "rollout.sglang.health_timeout_s=300",
             "checkpoint.save_every_steps=2"]
    results = run_on_ranks(_train, world_size=2, timeout_s=600,
                           overrides=_overrides(assets, tmp_path, *extra))
    assert [r["code"] for r in results] == [0, 0]
    rows = _check_run(tmp_path, 4)
    assert [r["rollout/policy_lag_steps"] <= 2 for r in rows[1:]] == [True] * 4
    assert max(r["async/lag_mean"] for r in rows[1:]) > 0  # it did train on stale samples
    assert (tmp_path / "async_groups.jsonl").is_file()
    # The periodic save of step 2 holds the generator's state as the ledger saw it then: every
    # group admitted by then was taken (steps 1-2), dropped, buffered or in flight, once.
    from gspo_megatron.trainer.schedule.k_stale_ledger import read_ledger

    saved = torch.load(tmp_path / "checkpoints" / "step_000002" / "common.pt",
                       weights_only=False)["extra"]["pending_rollout"]["async"]
    ledger = [r for r in read_ledger(tmp_path / "async_groups.jsonl") if r["step"] <= 2]
    named = [i for r in ledger for i, *_ in r.get("taken", []) + r.get("dropped", [])]
    named += [int(g["index"]) for g in saved["buffer"]] + [int(i) for i, _ in saved["in_flight"]]
    assert sorted(named) == list(range(saved["admitted"])) and saved["admitted"] >= 2 * 4
    assert all("train/tis_weight_mean" in r and "train/tis_truncated_frac" in r for r in rows[1:])
    # The lags recounted from the versions the server reported, without the trainer's map.
    from tests.lag_audit import lag_mismatches, off_by_one

    ledger = read_ledger(tmp_path / "async_groups.jsonl")
    assert lag_mismatches(rows, ledger, num_mini_batches=2, max_staleness=2) == []
    assert lag_mismatches(off_by_one(rows, 2), ledger, num_mini_batches=2, max_staleness=2)
    saved = (tmp_path / "config.yaml").read_text()
    assert "mode: truncate" in saved and "level: sequence" in saved  # what ran, not "auto"


def _spawn(assets, run_dir: Path, *extra: str, env_extra=None) -> subprocess.Popen:
    """gspo-train in a child process; its stderr goes to ``<run_dir>.log`` (read by _tail)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(env_extra or {}))
    log = open(f"{run_dir}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "gspo_megatron.cli.train",
                             str(REPO / "configs" / "tiny_cpu.yaml"),
                             *_overrides(assets, run_dir, "trainer.num_steps=4",
                                         "checkpoint.save_every_steps=1", *extra)],
                            env=env, stdout=subprocess.DEVNULL, stderr=log)
    log.close()
    return proc


def _assert_same_final_weights(run_dir: Path, ref_dir: Path) -> None:
    """The exported policies are equal bit for bit: the optimizer state a resume restored (Adam's
    moments and step count) decides every update after it, which the metrics of the steps
    before the last update would not show."""
    from safetensors.torch import load_file

    def weights(d: Path):
        out = {}
        for f in sorted((d / "hf_export").glob("*.safetensors")):
            out.update(load_file(f))
        return out

    got, want = weights(run_dir), weights(ref_dir)
    assert want and got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def _tail(run_dir: Path) -> str:
    return Path(f"{run_dir}.log").read_text(errors="replace")[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["on_policy", "overlap_learner_pi_old_r3"])
def test_killed_run_resumes_to_identical_metrics(assets, tmp_path, overlap):
    """With the overlap, the checkpoint of step 2 carries the in-flight rollout of step 3 and its
    pi_old, computed by the learner under the generating weights, which are gone after the kill,
    and (R3) the engine's routing of its samples, which the resumed run replays.
    The reference and the victim run side by side (independent processes, two cores)."""
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    flags = (f"rollout.overlap_one_step={str(overlap).lower()}",)
    if overlap:
        flags += ("algo.old_logprob_source=learner", "algo.routing_replay=rollout")
    ref = _spawn(assets, ref_dir, *flags)
    victim = _spawn(assets, killed_dir, *flags)
    deadline = time.monotonic() + 600
    while not (killed_dir / "checkpoints" / "step_000002" / "gspo_meta.json").exists():
        assert victim.poll() is None, _tail(killed_dir)
        assert time.monotonic() < deadline, "no checkpoint of step 2 appeared"
        time.sleep(0.2)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=60)

    resumed = _spawn(assets, killed_dir, *flags, "--resume")
    assert resumed.wait(timeout=600) == 0, _tail(killed_dir)
    assert ref.wait(timeout=600) == 0, _tail(ref_dir)

    def comparable(rows):
        return [{k: v for k, v in r.items()
                 if not k.startswith(("time/", "memory/", "checkpoint/")) and "per_s" not in k
                 and "_s" != k[-2:]} for r in rows]

    assert comparable(_rows(killed_dir)) == comparable(_rows(ref_dir))
    _assert_same_final_weights(killed_dir, ref_dir)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _warn_during_the_rollout_of(step: int, proc, run_dir: Path, marks: Path, deadline: Path,
                                seconds_left: float) -> None:
    """Once step ``step - 1`` is logged and step ``step``'s rollout is being scored (the paced
    reward was called again), write the batch shell's deadline file and send SIGUSR1."""
    limit = time.monotonic() + 300
    while max((r["step"] for r in (_rows(run_dir) if (run_dir / "metrics.jsonl").exists()
                                   else [])), default=-1) < step - 1:
        assert proc.poll() is None and time.monotonic() < limit, _tail(run_dir)
        time.sleep(0.1)
    seen = _lines(marks)
    while _lines(marks) <= seen:
        assert proc.poll() is None and time.monotonic() < limit, _tail(run_dir)
        time.sleep(0.05)
    deadline.write_text(f"exit_by={time.time() + seconds_left}\n")
    proc.send_signal(signal.SIGUSR1)


@pytest.mark.slow
def test_a_warning_too_late_for_the_step_drops_it_or_stops_and_the_run_redoes_them(assets,
                                                                                 tmp_path):
    """Issue 49, at the deadline rule's two edges, with steps slowed by a sleeping reward (a
    step of ~4 s, a save of ~0.3 s): (1) SIGUSR1 during step 3's rollout with 1 s left: the
    rest of the step cannot fit, so the step is dropped and the state after step 2 saved
    (exit 124); (2) resumed, SIGUSR1 during step 4's rollout with the deadline passed: no
    room for a save, exit 125 and no new checkpoint, naming the checkpoint and the step to
    redo; (3) resumed again, the run redoes step 3 and 4: every metric equals an unbroken run's."""
    from gspo_megatron.trainer.preemption import NO_CHECKPOINT_EXIT_CODE, REQUEUE_EXIT_CODE

    ref_dir, run_dir = tmp_path / "ref", tmp_path / "cut"
    marks, deadline = tmp_path / "marks", tmp_path / "deadline.env"
    flags = ("reward.name=tests.paced_reward:tiny_addition", "checkpoint.save_every_steps=0")
    paced = {"GSPO_TEST_REWARD_SLEEP_S": "0.25", "GSPO_TEST_REWARD_MARKS": str(marks),
             "GSPO_DEADLINE_FILE": str(deadline)}
    ref = _spawn(assets, ref_dir, *flags)
    victim = _spawn(assets, run_dir, *flags, env_extra=paced)
    _warn_during_the_rollout_of(3, victim, run_dir, marks, deadline, seconds_left=1.0)
    assert victim.wait(timeout=300) == REQUEUE_EXIT_CODE, _tail(run_dir)
    log = _tail(run_dir)
    assert "dropped step 3 (" in log and "checkpointed the state after step 2" in log
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002"]
    assert (run_dir / "progress.env").read_text().splitlines()[:2] == [
        "trained_step=2", "checkpoint_step=2"]

    again = _spawn(assets, run_dir, *flags, "--resume", env_extra=paced)
    _warn_during_the_rollout_of(4, again, run_dir, marks, deadline, seconds_left=-1.0)
    assert again.wait(timeout=300) == NO_CHECKPOINT_EXIT_CODE, _tail(run_dir)
    assert ("stopping without a checkpoint; a resumed run starts from the checkpoint of step 2 "
            "and redoes 1 step(s) (exit 125)") in _tail(run_dir)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002"]

    last = _spawn(assets, run_dir, *flags, "--resume")
    assert last.wait(timeout=300) == 0, _tail(run_dir)
    assert ref.wait(timeout=300) == 0, _tail(ref_dir)

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/", "checkpoint/"))
                 and "per_s" not in k and "_s" != k[-2:]} for r in rows]

    assert comparable(_rows(run_dir)) == comparable(_rows(ref_dir))
    _assert_same_final_weights(run_dir, ref_dir)


@pytest.mark.slow
def test_a_warning_during_the_cold_start_keeps_what_it_learned(assets, tmp_path):
    """SIGUSR1 during the cold start (no deadline): the SFT steps so far are checkpointed as
    step 0 (exit 124), and the resumed run goes straight to RL from them."""
    from gspo_megatron.trainer.preemption import REQUEUE_EXIT_CODE

    run_dir = tmp_path / "run"
    flags = ("trainer.num_sft_steps=400", "trainer.sft_stop_loss=null", "trainer.num_steps=2")
    proc = _spawn(assets, run_dir, *flags)
    limit = time.monotonic() + 300
    while "sft step 1/400" not in _tail(run_dir):
        assert proc.poll() is None and time.monotonic() < limit, _tail(run_dir)
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=300) == REQUEUE_EXIT_CODE, _tail(run_dir)
    assert "checkpointed the cold start (step 0) after SIGUSR1" in _tail(run_dir)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000000"]
    done = Path(f"{run_dir}.log").stat().st_size
    again = _spawn(assets, run_dir, *flags, "--resume")
    assert again.wait(timeout=300) == 0, _tail(run_dir)
    resumed = Path(f"{run_dir}.log").read_text(errors="replace")[done:]
    assert "resumed from" in resumed and "step_000000 (step 0)" in resumed
    assert "sft step" not in resumed
    assert [r["step"] for r in _rows(run_dir)] == [1, 2]


def test_bad_inputs_stop_with_a_clear_error(assets, tmp_path, caplog, monkeypatch):
    from gspo_megatron.cli.train import EXIT_CONFIG

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 3}\nnot json\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    few = tmp_path / "few.jsonl"  # 3 usable prompts, one too long: fewer than a step's 4
    few.write_text("".join(f'{{"prompt": "{a}+1=", "answer": "{a + 1}"}}\n' for a in range(3)) +
                   '{"prompt": "1234567890+1=", "answer": "1234567891"}\n')
    cases = [([f"data.train_path={bad}"], f"{bad}:2"),
             ([f"data.train_path={empty}"], "dataset is empty"),
             ([f"data.train_path={few}"],
              "3 usable prompts (4 rows, 0 malformed, 1 longer than data.max_prompt_tokens=8), "
              "fewer than batch.num_prompts_per_step=4"),
             (["reward.name=no_such_reward"], "no_such_reward")]
    for extra, message in cases:
        caplog.clear()
        code = _train(0, _overrides(assets, tmp_path / "run", *extra, "trainer.num_steps=1"))["code"]
        assert code == EXIT_CONFIG, extra
        assert message in caplog.text, (extra, caplog.text[-2000:])
    # the variable of bf16 products on a CPU: named with its choices, before anything starts
    caplog.clear()
    monkeypatch.setenv("GSPO_CPU_BF16_MATMUL", "fast")
    code = _train(0, _overrides(assets, tmp_path / "run", "trainer.num_steps=1"))["code"]
    assert code == EXIT_CONFIG
    assert "GSPO_CPU_BF16_MATMUL='fast' is not one of auto, fp32, native" in caplog.text
    assert not (tmp_path / "run").exists()



@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_loop_with_reference_servers(assets, tmp_path, mode, caplog):
    """The trainer against a reference server process: colocated (memory released around the
    learner's phases, tensor handles through shared memory) and disaggregated (gloo broadcast,
    with R3: the server launched with the capture flag, every sample's routing replayed)."""
    from gspo_megatron.distributed.ports import free_port

    extra = ["trainer.num_steps=1", "rollout.engine=reference", f"rollout.mode={mode}",
             f"rollout.sglang.port={free_port()}", "rollout.sglang.health_timeout_s=300",
             "rollout.weight_sync.verify=true", "rollout.weight_sync.verify_tolerance=1e-5"]
    if mode == "disaggregated":
        extra += ["algo.routing_replay=rollout", "algo.old_logprob_source=learner"]
    caplog.set_level("INFO", logger="gspo_megatron.rollout.sglang.launcher")
    if mode == "disaggregated":  # what a Slurm job's fleet supervisor wrote (slurm/fleet.sh)
        tmp_path.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fleet_events.jsonl").write_text(
            '{"server": "server0", "address": "h:1", "event": "down", "reason": "exited with code 9"}\n'
            '{"server": "server0", "address": "h:1", "event": "restarted"}\n'
            '{"server": "server0", "address": "h:1", "event": "healthy", "down_s": 12}\n')
    assert _train(0, _overrides(assets, tmp_path, *extra))["code"] == 0
    rows = _check_run(tmp_path, 1)
    sync = rows[1]
    assert sync["rollout/live_servers"] == 1.0 and sync["rollout/dead_servers"] == 0.0
    if mode == "disaggregated":
        assert (sync["rollout/server_restarts"], sync["rollout/servers_down"], sync["rollout/server_down_s"]) == \
            (1.0, 0.0, 12.0)
    else:
        assert "rollout/server_restarts" not in sync  # no Slurm job, no fleet events
    assert sync["weight_sync/num_servers"] == 1.0 and sync["weight_sync/num_skipped_servers"] == 0.0
    assert sync["weight_sync/probe_abs_logp"] < 1e-5  # the probe after the sync (colocated too)
    for phase in ("pause", "begin", "end", "transfer"):
        assert f"weight_sync/{phase}_s" in sync
    assert ("weight_sync/continue_s" in sync) == (mode == "disaggregated")  # colocated: on resume
    if mode == "disaggregated":  # R3: the learner routed as the server did, same log-probs
        assert sync["rollout/learner_vs_engine_abs_logp"] < 1e-4
        started = [r.getMessage() for r in caplog.records if "started rollout server" in r.getMessage()]
        assert started and all("--enable-return-routed-experts" in m for m in started), started


@pytest.mark.slow
def test_overlap_with_a_disaggregated_reference_server(assets, tmp_path):
    """One-step off-policy against a server process: the rollout of step 3 is generated on the
    server while step 2 trains, by the weights synced after step 1 (sync between take and
    submit, so no generation is in flight when the update protocol pauses the server)."""
    from gspo_megatron.distributed.ports import free_port

    extra = ["trainer.num_steps=3", "rollout.engine=reference", "rollout.mode=disaggregated",
             "rollout.overlap_one_step=true", f"rollout.sglang.port={free_port()}",
             "rollout.sglang.health_timeout_s=300"]
    assert _train(0, _overrides(assets, tmp_path, *extra))["code"] == 0
    rows = _check_run(tmp_path, 3, first_synced_step=2)
    assert [r["rollout/policy_lag_steps"] for r in rows[1:]] == [0.0, 1.0, 1.0]
    for row in rows[2:]:
        assert row["weight_sync/num_servers"] == 1.0 and "weight_sync/continue_s" in row


def _train_against_one_reference_server(assets, run_dir: Path, caplog, server_args, *extra: str):
    """gspo-train (in this process) attached to one reference server started here with
    ``server_args``; returns (exit code, the server's address, gspo-train's ERROR records)."""
    import logging

    from gspo_megatron.distributed.ports import free_port
    from gspo_megatron.rollout.sglang.launcher import ServerLauncher
    from gspo_megatron.rollout.standin.launcher import reference_server_command

    port = free_port()
    address = f"127.0.0.1:{port}"
    launcher = ServerLauncher(str(run_dir.parent / "logs"), env={"OMP_NUM_THREADS": "1"})
    launcher.start(reference_server_command(str(assets.model_dir), port, python=sys.executable,
                                            extra=list(server_args)), address)
    try:
        overrides = ["rollout.engine=reference", "rollout.mode=disaggregated",
                     f"rollout.sglang.server_addresses=[{address}]",
                     "rollout.sglang.health_timeout_s=300", *extra]
        with caplog.at_level(logging.ERROR):
            code = _train(0, _overrides(assets, run_dir, *overrides))["code"]
    finally:
        launcher.stop()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == "gspo-train"]
    return code, address, errors


@pytest.mark.slow
def test_a_dead_rollout_server_ends_the_run_with_one_line_and_exit_5(assets, tmp_path, caplog):
    """The only server dies mid-rollout (the stand-in exits on its 5th /generate): the run stops
    with EXIT_ROLLOUT and one error line naming a sample, not a traceback; the checkpoint of the
    step before stays."""
    from gspo_megatron.cli.train import EXIT_ROLLOUT

    code, _, errors = _train_against_one_reference_server(
        assets, tmp_path / "run", caplog, ["--exit-on-request", "40"], "trainer.num_steps=4",
        "rollout.sglang.max_retries=1", "checkpoint.save_every_steps=1")
    assert code == EXIT_ROLLOUT
    assert errors and "rollout servers: sample (prompt_id=" in errors[-1].getMessage()
    assert errors[-1].exc_info is None  # one line, no traceback
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_000001"]


@pytest.mark.slow
def test_r3_against_a_server_without_the_capture_ends_with_one_line_and_exit_5(assets, tmp_path,
                                                                             caplog):
    """algo.routing_replay=rollout attached to a server started without
    --enable-return-routed-experts: the first rollout's answers lack the routing; the run stops
    with EXIT_ROLLOUT and one line naming the server and the flag, before any update."""
    from gspo_megatron.cli.train import EXIT_ROLLOUT

    code, address, errors = _train_against_one_reference_server(
        assets, tmp_path / "run", caplog, [], "trainer.num_steps=2", "algo.routing_replay=rollout")
    assert code == EXIT_ROLLOUT
    message = errors[-1].getMessage()
    assert f"{address}, request" in message and "--enable-return-routed-experts" in message
    assert errors[-1].exc_info is None
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or len(_rows(tmp_path / "run")) <= 1

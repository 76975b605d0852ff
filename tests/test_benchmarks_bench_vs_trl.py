"""The gspo-train side of benchmarks/bench_vs_trl.py (its setup, vs_trl_setup.py, which the sweep and
bench_trees.py reuse): the command it runs is a valid config for every side, and the summary's
ratio is TRL's over ours."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import bench_vs_trl, vs_trl_setup
from gspo_megatron.config.load import load_config


def _args(**kw):
    base = dict(steps=10, prompts=8, samples=8, max_new_tokens=16, with_diagnostics=False)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("side", sorted(vs_trl_setup.GSPO_SIDES))
def test_every_gspo_side_is_a_valid_config_of_the_stated_setup(tmp_path, side):
    cmd = vs_trl_setup.gspo_command(_args(), Path("/assets"), tmp_path,
                                    vs_trl_setup.GSPO_SIDES[side])
    assert cmd[1:3] == ["-m", "gspo_megatron.cli.train"]
    cfg = load_config(cmd[3], cmd[4:])  # unknown or renamed keys would raise here
    assert (cfg.batch.num_prompts_per_step, cfg.rollout.n_samples_per_prompt) == (8, 8)
    assert cfg.batch.num_mini_batches == vs_trl_setup.STEPS_PER_GENERATION
    assert cfg.rollout.max_new_tokens == 16 and cfg.trainer.num_steps == 10
    assert (cfg.algo.clip_eps_low, cfg.algo.clip_eps_high) == (3e-4, 4e-4)  # TRL side's epsilons
    assert cfg.optimizer.lr == 1e-5 and cfg.optimizer.lr_decay_style == "constant"
    assert cfg.algo.diagnostics.expert_volatility_num_seqs == 0
    assert cfg.rollout.overlap_one_step == (side == "gspo_overlap")
    assert cfg.algo.old_logprob_source == ("learner" if side == "gspo_learner_lp" else "rollout")


def test_diagnostics_stay_on_when_asked(tmp_path):
    cmd = vs_trl_setup.gspo_command(_args(with_diagnostics=True), Path("/a"), tmp_path, [])
    assert load_config(cmd[3], cmd[4:]).algo.diagnostics.expert_volatility_num_seqs > 0


def test_summary_ratio_is_trl_step_time_over_ours():
    rows = [{"side": s, "step_s_median": t, "tokens_per_s": 1.0, "whole_process_s": 1.0}
            for s, t in [("trl", 1.0), ("trl", 1.2), ("gspo", 0.5), ("gspo", 0.7)]]
    table = bench_vs_trl.summarise(rows, ["trl", "gspo"])
    assert "| trl | 1.100 |" in table and table.rstrip().endswith("1.83x |")


def test_the_sweep_gets_its_own_default_sides(monkeypatch):
    """--sweep without --sides runs the sweep's sides (both pi_old sources next to TRL), not the
    single-shape mode's default (a first sweep lost the learner side that way)."""
    from benchmarks import bench_vs_trl_sweep

    seen = {}
    fake = SimpleNamespace(DEFAULTS=bench_vs_trl_sweep.DEFAULTS,
                           run_sweep=lambda args: seen.setdefault("sides", args.sides) and 0)
    import sys

    monkeypatch.setitem(sys.modules, "bench_vs_trl_sweep", fake)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts benchmarks/ on it
    assert bench_vs_trl.main(["--sweep"]) == 0
    assert seen["sides"] == "trl,gspo,gspo_learner_lp,gspo_overlap"
    seen.clear()
    bench_vs_trl.main(["--sweep", "--sides", "trl,gspo"])
    assert seen["sides"] == "trl,gspo"

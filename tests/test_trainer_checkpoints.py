"""The run's checkpoints: resume from the newest complete step (damaged ones named and skipped),
refuse a changed dataset before loading anything, rotate without ever deleting the only complete
checkpoint, and keep a fresh start from mixing with an earlier run's checkpoints."""

from __future__ import annotations

import json
import logging
import threading

import pytest
from omegaconf import OmegaConf

from gspo_megatron.config.schema import GSPOConfig
from gspo_megatron.config.validate import ConfigError
from gspo_megatron.learner.checkpoint_files import step_dir, write_manifest
import gspo_megatron.trainer.checkpoints as checkpoints_module
from gspo_megatron.trainer.checkpoints import RunCheckpoints, data_identity, plan_resume

SAMPLER = {"seed": 1234, "shuffle": True, "fingerprint": "abc", "num_records": 100,
           "epoch": 0, "position": 8, "num_drawn": 8, "retired": {}}
DATA = data_identity("train.jsonl", SAMPLER)


def _cfg(tmp_path, **checkpoint):
    cfg = OmegaConf.structured(GSPOConfig)
    cfg.logging.run_dir = str(tmp_path)
    for key, value in checkpoint.items():
        cfg.checkpoint[key] = value
    return cfg


def _fake_save(directory, data=DATA, step=0, **meta):
    """The files of a checkpoint, as learner.save_checkpoint would leave them."""
    directory.mkdir(parents=True)
    (directory / "gspo_meta.json").write_text(json.dumps({"format": "gspo-megatron-v1",
                                                          "step": step, "data": data, **meta}))
    for name in ("common.pt", ".metadata", "metadata.json", "__0_0.distcp"):
        (directory / name).write_bytes(b"x" * 64)
    write_manifest(directory)


class FakeLearner:
    def __init__(self):
        self.loaded = None

    def save_checkpoint(self, directory, extra, meta, background=False):
        from gspo_megatron.learner.checkpoint_write import SaveReport

        _fake_save(directory, meta["data"], extra["trainer_step"])
        return SaveReport(str(directory), 0.1, 0.2, 100, 200, 300)

    def load_checkpoint(self, directory):
        self.loaded = directory
        return {"trainer_step": int(directory.name[5:]), "sampler": SAMPLER}


class FakeSampler:
    def __init__(self, state=SAMPLER):
        self.state = state
        self.loaded = None

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        if state["fingerprint"] != self.state["fingerprint"]:
            raise ValueError("sampler state does not match this dataset/settings")
        self.loaded = state


def _root(tmp_path):
    return tmp_path / "checkpoints"


def test_resume_from_newest_complete_step_skipping_damaged_ones(tmp_path, caplog):
    for step in (2, 4, 6):
        _fake_save(step_dir(_root(tmp_path), step))
    (step_dir(_root(tmp_path), 6) / "__0_0.distcp").unlink()  # damaged newest
    cfg = _cfg(tmp_path)
    with caplog.at_level(logging.INFO):
        where = plan_resume(cfg, DATA, is_main=True)
    assert where == step_dir(_root(tmp_path), 4)
    assert "skipping damaged checkpoint" in caplog.text and "step_000006" in caplog.text
    learner, sampler = FakeLearner(), FakeSampler()
    state = RunCheckpoints(cfg, learner, sampler, True, DATA, where).resume()
    assert state.step == 4 and learner.loaded == where and sampler.loaded == SAMPLER


def test_no_checkpoint_is_a_fresh_start_or_an_error_when_resume_is_required(tmp_path):
    assert plan_resume(_cfg(tmp_path), DATA, is_main=True) is None
    _fake_save(step_dir(_root(tmp_path), 1))
    (step_dir(_root(tmp_path), 1) / "manifest.json").unlink()
    with pytest.raises(ConfigError, match=r"resume=always but .* no complete checkpoint \(1 "
                                          "damaged\\)"):
        plan_resume(_cfg(tmp_path, resume="always"), DATA, is_main=True)


@pytest.mark.parametrize("changed, message", [
    (dict(fingerprint="zzz", num_records=90),
     "data.train_path changed since .*\\(100 prompts, id fingerprint abc\\), now other.jsonl has "
     "90 prompts"),
    (dict(seed=7), "trainer.seed is 7 but .* was trained with trainer.seed=1234"),
    (dict(shuffle=False), "data.shuffle is False"),
])
def test_changed_data_is_refused_before_loading_with_the_way_out(tmp_path, changed, message):
    _fake_save(step_dir(_root(tmp_path), 3))
    now = data_identity("other.jsonl", {**SAMPLER, **changed})
    with pytest.raises(ConfigError, match=message) as info:
        plan_resume(_cfg(tmp_path), now, is_main=True)
    assert "logging.run_dir" in str(info.value) and "checkpoint.resume=never" in str(info.value)


def test_a_fast_form_checkpoint_of_another_layout_is_refused_with_the_conversion(tmp_path):
    """Issue 49: the optimizer's fast form loads under its own layout only (the data-parallel
    size may change); another one is refused before the learner is built, with the command
    that writes the portable form."""
    saved = {"tp": 2, "pp": 1, "vpp": None, "num_layers_in_first_pipeline_stage": None,
             "num_layers_in_last_pipeline_stage": None, "ep": 8, "etp": 1, "cp": 1}
    _fake_save(step_dir(_root(tmp_path), 3), optimizer_form="dp_sharded", world_size=16,
               parallel=saved)
    cfg = _cfg(tmp_path)
    cfg.parallel.tp, cfg.parallel.ep = 2, 8
    cfg.parallel.world_size = 32  # more data parallelism: fine
    assert plan_resume(cfg, DATA, is_main=True) == step_dir(_root(tmp_path), 3)
    cfg.parallel.tp = 4
    with pytest.raises(ConfigError) as info:
        plan_resume(cfg, DATA, is_main=True)
    message = str(info.value)
    assert "step_000003: its optimizer state is in the fast form" in message
    assert "(parallel.tp=2 -> 4)" in message
    assert (f"torchrun --nproc-per-node=16 -m gspo_megatron.cli.reshard --portable-optimizer "
            f"--ckpt {step_dir(_root(tmp_path), 3)} --config {tmp_path}/config.yaml") in message
    _fake_save(step_dir(_root(tmp_path), 4), optimizer_form="portable", world_size=16,
               parallel=saved)  # the portable form: any layout
    assert plan_resume(cfg, DATA, is_main=True) == step_dir(_root(tmp_path), 4)


def test_resume_never_moves_earlier_checkpoints_aside(tmp_path):
    _fake_save(step_dir(_root(tmp_path), 5))
    cfg = _cfg(tmp_path, resume="never")
    assert plan_resume(cfg, DATA, is_main=True) is None
    assert RunCheckpoints(cfg, FakeLearner(), FakeSampler(), True, DATA, None).resume() is None
    moved = list(_root(tmp_path).glob("superseded_*/step_000005"))
    assert len(moved) == 1 and not step_dir(_root(tmp_path), 5).exists()
    assert plan_resume(_cfg(tmp_path), DATA, is_main=True) is None  # auto: not resumed from


def test_rotation_keeps_the_newest_complete_ones_and_never_the_only_one(tmp_path):
    cfg = _cfg(tmp_path, keep_last=2)
    ckpts = RunCheckpoints(cfg, FakeLearner(), FakeSampler(), True, DATA, None)
    _fake_save(step_dir(_root(tmp_path), 1))
    (step_dir(_root(tmp_path), 1) / "common.pt").unlink()  # damaged, older than the new ones
    for step in (2, 3, 4):
        ckpts.save(step)
    ckpts.wait_for_deletes()  # a retired step is renamed at once, deleted by a thread
    assert sorted(p.name for p in _root(tmp_path).iterdir()) == ["step_000003", "step_000004"]
    # Newer steps damaged: the one complete checkpoint stays, whatever keep_last says.
    cfg.checkpoint.keep_last = 1
    _fake_save(step_dir(_root(tmp_path), 9))
    (step_dir(_root(tmp_path), 9) / "manifest.json").unlink()
    ckpts.rotate()
    ckpts.close()
    assert sorted(p.name for p in _root(tmp_path).iterdir()) == ["step_000004", "step_000009"]
    records = [json.loads(line) for line in (tmp_path / "checkpoints.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4] and records[0]["total_s"] == 0.2


def test_a_retired_step_is_out_of_the_way_at_once_and_its_leftover_removed_at_start(tmp_path):
    """Rotation renames before it deletes (in a thread): a resume never sees a half-deleted
    step as a checkpoint, and start-up removes a rename whose delete did not finish."""
    from gspo_megatron.learner.checkpoint_files import clean_leftovers, scan_steps

    cfg = _cfg(tmp_path, keep_last=1)
    ckpts = RunCheckpoints(cfg, FakeLearner(), FakeSampler(), True, DATA, None)
    deleted = threading.Event()
    real_delete = checkpoints_module._delete

    def slow_delete(paths):
        assert all(p.name.endswith(".deleting") for p in paths)
        assert [s for s, _ in scan_steps(_root(tmp_path)).complete] == [2]  # out of the way
        deleted.wait(10)
        real_delete(paths)

    checkpoints_module._delete = slow_delete
    try:
        ckpts.save(1)
        ckpts.save(2)  # retires step 1 while its delete waits
        assert (_root(tmp_path) / "step_000001.deleting").is_dir()
        assert clean_leftovers(_root(tmp_path)) == [_root(tmp_path) / "step_000001.deleting"]
    finally:
        deleted.set()
        checkpoints_module._delete = real_delete
        ckpts.close()
    assert sorted(p.name for p in _root(tmp_path).iterdir()) == ["step_000002"]


def test_old_checkpoint_without_data_record_still_explains_a_mismatch(tmp_path):
    _fake_save(step_dir(_root(tmp_path), 2), data=None)
    where = plan_resume(_cfg(tmp_path), DATA, is_main=True)
    sampler = FakeSampler({**SAMPLER, "fingerprint": "new"})
    with pytest.raises(ConfigError, match="sampler state does not match.*logging.run_dir"):
        RunCheckpoints(_cfg(tmp_path), FakeLearner(), sampler, True, DATA, where).resume()

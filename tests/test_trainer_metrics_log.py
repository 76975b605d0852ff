"""metrics.jsonl and the wandb run agree with the checkpoint a run starts from: rows past the
resumed step (all rows on a fresh start) are dropped, a torn last line is tolerated, and the
wandb run holds exactly the kept rows."""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import types
from dataclasses import dataclass

import pytest

from gspo_megatron.trainer.metrics_log import METRICS_FILE, WANDB_STATE_FILE, MetricsLogger


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def _write_rows(run_dir, steps, torn: bool = False):
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"step": s, "reward/mean": 0.1 * s}) + "\n" for s in steps)
    if torn:
        text += '{"step": 99, "reward/me'
    (run_dir / METRICS_FILE).write_text(text)


def test_resume_drops_rows_past_the_checkpoint_and_a_torn_line(tmp_path, caplog):
    _write_rows(tmp_path, [0, 1, 2, 3, 4], torn=True)
    logger = MetricsLogger(tmp_path)
    with caplog.at_level(logging.WARNING):
        logger.start(resumed_step=2)
    assert "dropping a torn last line" in caplog.text and f"{METRICS_FILE}:6" in caplog.text
    assert _steps(tmp_path) == [0, 1, 2] and [r["step"] for r in logger.history] == [0, 1, 2]
    logger.log(3, {"reward/mean": 0.5})
    assert _steps(tmp_path) == [0, 1, 2, 3]


def test_fresh_start_in_a_used_run_directory_starts_an_empty_file(tmp_path):
    _write_rows(tmp_path, [0, 1, 2])  # a crash before the first checkpoint left these
    logger = MetricsLogger(tmp_path)
    logger.start(resumed_step=None)
    logger.log(0, {"eval/accuracy": 0.2})
    logger.log(1, {"reward/mean": 0.3})
    assert _steps(tmp_path) == [0, 1]  # no step appears twice


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", enabled=False)
    logger.start(None)
    logger.log(1, {"x": 1.0})
    assert not (tmp_path / "run").exists()


class FakeRun:
    def __init__(self, kwargs):
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, metrics, step):
        self.logged.append(step)

    def finish(self):
        self.finished = True


@pytest.fixture()
def fake_wandb(monkeypatch):
    runs = []
    module = types.SimpleNamespace()

    def init(**kwargs):
        runs.append(FakeRun(kwargs))
        return runs[-1]

    module.init = init
    module.teardown = lambda: setattr(runs[-1], "torn_down", True)
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.setenv("WANDB_DIR", "unused")
    monkeypatch.setenv("WANDB_CACHE_DIR", "unused")
    return runs


@dataclass
class Wandb:
    enabled: bool = True
    mode: str = "offline"
    project: str = "p"
    entity: str = None
    name: str = None
    group: str = None


def test_wandb_run_continues_when_nothing_was_logged_past_the_checkpoint(tmp_path, fake_wandb):
    first = MetricsLogger(tmp_path, Wandb())
    first.start(None)
    for step in (0, 1, 2):
        first.log(step, {"reward/mean": 0.1})
    first.close()  # e.g. preempted right after the checkpoint of step 2
    assert fake_wandb[0].finished and fake_wandb[0].torn_down  # wandb's service ends with the run
    second = MetricsLogger(tmp_path, Wandb())
    second.start(resumed_step=2)
    assert fake_wandb[1].kwargs["id"] == fake_wandb[0].kwargs["id"]
    assert fake_wandb[1].logged == []  # nothing replayed into the same run


def test_wandb_history_past_the_checkpoint_moves_to_a_new_run_with_the_kept_rows(tmp_path,
                                                                                 fake_wandb):
    first = MetricsLogger(tmp_path, Wandb())
    first.start(None)
    for step in (0, 1, 2, 3):
        first.log(step, {"reward/mean": 0.1})  # killed after step 3; checkpoint at step 2
    second = MetricsLogger(tmp_path, Wandb())
    second.start(resumed_step=2)
    new_id = fake_wandb[1].kwargs["id"]
    assert new_id != fake_wandb[0].kwargs["id"] and fake_wandb[1].logged == [0, 1, 2]
    assert json.loads((tmp_path / WANDB_STATE_FILE).read_text()) == {"id": new_id}
    second.log(3, {"reward/mean": 0.2})
    assert fake_wandb[1].logged == [0, 1, 2, 3] == _steps(tmp_path)


def test_real_wandb_offline_continues_the_same_run_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = MetricsLogger(tmp_path, Wandb())
    first.start(None)
    first.log(0, {"reward/mean": 0.1})
    first.close()
    run_id = json.loads((tmp_path / WANDB_STATE_FILE).read_text())["id"]
    second = MetricsLogger(tmp_path, Wandb())
    second.start(resumed_step=0)
    second.log(1, {"reward/mean": 0.2})
    second.close()
    # close() ended wandb's service: its asyncio thread is gone (issue 41: it ran on beside
    # every later test of the suite)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("wandb")]
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    # offline-run-<second>-<id>; wandb adds "-1" when both runs start within the same second
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", name)
                                  for name in runs), runs


def test_a_grid_point_joins_its_grid_group_in_wandb(tmp_path, fake_wandb):
    """``gspo-grid submit`` sets logging.wandb.group / name per point: the run carries them."""
    logger = MetricsLogger(tmp_path, Wandb(name="lr_sweep-p3", group="lr_sweep"),
                           config_dict={"optimizer": {"lr": 2e-6}})
    logger.start(None)
    kwargs = fake_wandb[0].kwargs
    assert (kwargs["group"], kwargs["name"], kwargs["config"]) == \
        ("lr_sweep", "lr_sweep-p3", {"optimizer": {"lr": 2e-6}})

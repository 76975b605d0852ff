"""Colocated start order (issue 29 item 2), on the stand-in's simulated GPU.

The reference server keeps SGLang's static pool on a memory ledger (``rollout/standin/memory_ledger.py``)
and the learner's memory is added to the same ledger by hooks on ``Learner`` (resident state
after build, a transient while building, activations during each update). The budget is set so
that the order matters, as it does on an 80 GB GPU for the 30B model (``planner/colocated.py``):

- servers' static pool 50, learner resident 40, build transient 20, activations 30 (MB of a
  100 MB GPU): built beside a server that still holds its pool, the learner needs 110;
- released first, the learner builds in 60; the first sync holds resident + server weights; the
  rollout resident + the pool (90); the updates resident + activations (70).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gspo_megatron.rollout.standin.memory_ledger import LEDGER_ENV, MemoryLedger, OutOfMemory

REPO = Path(__file__).resolve().parents[1]
MB = 1 << 20
BUDGET, RESIDENT, BUILD, ACTIVATIONS = 100 * MB, 40 * MB, 20 * MB, 30 * MB


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from gspo_megatron.tiny_task.assets import make_tiny_assets
    from gspo_megatron.tiny_task.task import AdditionTaskConfig

    return make_tiny_assets(tmp_path_factory.mktemp("tiny_assets"),
                            task=AdditionTaskConfig(num_train=200, num_eval=16))


def _learner_on(ledger: MemoryLedger, monkeypatch) -> None:
    """The learner's GPU memory on the ledger: what a Megatron learner allocates, in its order."""
    import gspo_megatron.trainer.build as build
    from gspo_megatron.learner.learner import Learner

    class LedgerLearner(Learner):
        def __init__(self, *args, **kwargs):
            ledger.allocate("learner", "build buffers", BUILD)
            ledger.allocate("learner", "resident", RESIDENT)
            super().__init__(*args, **kwargs)
            ledger.free("learner", "build buffers")

        def train_step(self, *args, **kwargs):
            ledger.allocate("learner", "activations", ACTIVATIONS)
            try:
                return super().train_step(*args, **kwargs)
            finally:
                ledger.free("learner", "activations")

    monkeypatch.setattr(build, "Learner", LedgerLearner)


def _run(assets, run_dir: Path, ledger_path: Path, monkeypatch) -> int:
    from gspo_megatron.cli.train import main
    from gspo_megatron.distributed.ports import free_port

    monkeypatch.setenv(LEDGER_ENV, str(ledger_path))
    return main([str(REPO / "configs" / "tiny_cpu.yaml"), f"model.hf_path={assets.model_dir}",
                 f"data.train_path={assets.train_path}", f"data.eval_path={assets.eval_path}",
                 f"logging.run_dir={run_dir}",
                 "logging.wandb.enabled=false", "batch.num_prompts_per_step=4",
                 "rollout.n_samples_per_prompt=4", "batch.num_mini_batches=2",
                 "trainer.num_sft_steps=1", "trainer.sft_batch_size=8", "trainer.eval_every_steps=0",
                 "checkpoint.save_every_steps=0", "trainer.num_steps=2", "rollout.engine=reference",
                 "rollout.mode=colocated", f"rollout.sglang.port={free_port()}",
                 "rollout.sglang.mem_fraction_static=0.5", "rollout.sglang.health_timeout_s=300"])


def _first(events, op, key_part, after=0):
    return next(i for i, (o, key, _, _) in enumerate(events) if i >= after and o == op and key_part in key)


@pytest.mark.slow
def test_servers_release_before_the_learner_is_built_and_every_phase_fits(assets, tmp_path, monkeypatch):
    ledger = MemoryLedger.create(str(tmp_path / "gpu0.json"), BUDGET)
    _learner_on(ledger, monkeypatch)
    assert _run(assets, tmp_path / "run", tmp_path / "gpu0.json", monkeypatch) == 0
    events = ledger.events()
    assert not [e for e in events if e[0] == "refused"], events
    pool = _first(events, "allocate", "/kv_cache")
    released = _first(events, "free", "/kv_cache", after=pool)
    built = _first(events, "allocate", "learner/resident")
    assert pool < released < built  # the learner is built in what the servers gave back
    weights_back = _first(events, "allocate", "/weights", after=built)
    kv_back = _first(events, "allocate", "/kv_cache", after=built)
    assert weights_back < kv_back  # the first sync resumes only the weights
    first_update = _first(events, "allocate", "learner/activations", after=kv_back)
    assert _first(events, "free", "/kv_cache", after=kv_back) < first_update  # released again
    assert max(used for *_, used in events) == RESIDENT + 50 * MB  # the rollout: resident + pool
    assert ledger.state()["held"]["learner/resident"] == RESIDENT


@pytest.mark.slow
def test_the_old_order_does_not_fit_the_same_gpu(assets, tmp_path, monkeypatch):
    """The stand-in is strict enough to see issue 29's fault: with the release at start skipped
    (the learner built beside a server holding its pool), the learner's build is refused."""
    from gspo_megatron.rollout.sglang.engine import SGLangEngine

    ledger = MemoryLedger.create(str(tmp_path / "gpu0.json"), BUDGET)
    _learner_on(ledger, monkeypatch)
    calls = {"n": 0}
    release = SGLangEngine.release_memory

    def release_after_first_rollout_only(self):
        calls["n"] += 1
        if calls["n"] > 1:
            release(self)

    monkeypatch.setattr(SGLangEngine, "release_memory", release_after_first_rollout_only)
    with pytest.raises(OutOfMemory, match=r"learner/resident needs 41943040 bytes, 31457280 of "
                                          r"104857600 free .*server:\d+/kv_cache 5\d{7}"):
        _run(assets, tmp_path / "run", tmp_path / "gpu0.json", monkeypatch)

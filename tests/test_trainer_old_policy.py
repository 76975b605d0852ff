"""pi_old per mini-batch: engine log-probs untouched, or one learner pass per mini-batch that
records the routing to replay when routing replay is on (a stand-in learner counts the calls;
the real one runs in test_trainer_loop.py)."""

from __future__ import annotations

import torch

from gspo_megatron.config.schema import GSPOConfig
from gspo_megatron.learner.batch import SequenceBatch
from gspo_megatron.learner.learner import LogprobOutput
from gspo_megatron.trainer.old_policy import old_policy_pass


def _batch(n: int = 8) -> SequenceBatch:
    engine = [torch.full((2,), -1.0) for _ in range(n)]
    return SequenceBatch(token_ids=[[1, 2, 3, 4]] * n, prompt_lens=[2] * n, advantages=[0.5] * n,
                         old_logprobs=engine, rollout_logprobs=engine)


class _Learner:
    def __init__(self):
        self.calls = []

    def compute_logprobs(self, batch, record_routing=False, replay=None):
        self.calls.append((len(batch), record_routing, replay))
        return LogprobOutput([torch.full((2,), -1.25)] * len(batch), [torch.zeros(2)] * len(batch),
                             routing=f"tape{len(self.calls)}" if record_routing else None)

    def rollout_routing(self, batch):
        return f"engine routing of {len(batch)}"


def _cfg(source: str, replay: str = "off") -> GSPOConfig:
    cfg = GSPOConfig()
    cfg.rollout.n_samples_per_prompt, cfg.batch.num_mini_batches = 2, 4
    cfg.algo.old_logprob_source, cfg.algo.routing_replay = source, replay
    return cfg


def test_engine_log_probs_need_no_learner_pass():
    learner = _Learner()
    old = old_policy_pass(learner, _batch(), _cfg("rollout"))
    assert learner.calls == [] and old.routings == [None] * 4 and old.metrics == {}
    assert [len(m) for m in old.mini_batches] == [2, 2, 2, 2]
    assert float(old.mini_batches[0].old_logprobs[0][0]) == -1.0


def test_learner_pass_per_mini_batch_records_routing_for_replay():
    learner = _Learner()
    old = old_policy_pass(learner, _batch(), _cfg("learner", replay="learner"))
    assert learner.calls == [(2, True, None)] * 4
    assert old.routings == ["tape1", "tape2", "tape3", "tape4"]
    assert float(old.mini_batches[3].old_logprobs[1][0]) == -1.25
    assert old.metrics["rollout/learner_vs_engine_abs_logp"] == 0.25
    plain = _Learner()
    assert old_policy_pass(plain, _batch(), _cfg("learner")).routings == [None] * 4
    assert plain.calls == [(2, False, None)] * 4


def test_rollout_routing_is_replayed_by_the_old_policy_pass_and_the_training_passes():
    """R3: the engine's routing of every mini-batch goes to the learner's pi_old pass and, as
    the routing to replay, to the training passes; with engine log-probs there is no pass."""
    learner = _Learner()
    old = old_policy_pass(learner, _batch(), _cfg("learner", replay="rollout"))
    assert learner.calls == [(2, False, "engine routing of 2")] * 4
    assert old.routings == ["engine routing of 2"] * 4
    engine_only = _Learner()
    old = old_policy_pass(engine_only, _batch(), _cfg("rollout", replay="rollout"))
    assert engine_only.calls == [] and old.routings == ["engine routing of 2"] * 4


def test_saved_pi_old_is_attached_without_a_pass():
    """A restored in-flight rollout (one-step off-policy) brings its pi_old from the checkpoint."""
    import pytest

    learner = _Learner()
    saved = [[torch.full((2,), -1.5 - i)] * 2 for i in range(4)]
    old = old_policy_pass(learner, _batch(), _cfg("learner"), saved=saved)
    assert learner.calls == [] and old.routings == [None] * 4
    assert [float(m.old_logprobs[0][0]) for m in old.mini_batches] == [-1.5, -2.5, -3.5, -4.5]
    assert old.metrics["rollout/learner_vs_engine_abs_logp"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="do not match"):
        old_policy_pass(learner, _batch(), _cfg("learner"), saved=saved[:3])

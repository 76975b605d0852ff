"""The k = 0 and k = 1 schedules (``OnPolicyRollouts``, ``OneStepRollouts``: the machinery of
``stepwise.RolloutPipeline``) with a fake learner: hand-over order, background generation,
``prepare`` (the learner's pi_old) under the generating weights, the checkpoint round trip of an
in-flight rollout, and where each syncs around the update."""

import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from gspo_megatron.learner.weight_snapshot import WeightSnapshot, weights_swapped_in
from gspo_megatron.rollout.types import Sample
import gspo_megatron.trainer.schedule.stepwise as rp
from gspo_megatron.trainer.schedule.one_step import OneStepRollouts
from gspo_megatron.trainer.schedule.on_policy import OnPolicyRollouts


def _step_schedule(*args, overlap, **kwargs):
    """The schedule of k = int(overlap)."""
    return (OneStepRollouts if overlap else OnPolicyRollouts)(*args, **kwargs)
from gspo_megatron.trainer.schedule.collect import ScoredRollout


class FakeLearner:
    """One parameter; its 'log-probs' of a sequence are the parameter's value per token."""

    def __init__(self):
        self.model = [torch.nn.Linear(1, 1, bias=False)]
        with torch.no_grad():
            self.model[0].weight.zero_()
        self.step = 0

    @property
    def weight(self) -> float:
        return float(self.model[0].weight.detach())

    def update(self, value: float) -> None:
        with torch.no_grad():
            self.model[0].weight.fill_(value)
        self.step += 1

    def compute_logprobs(self, batch):
        lps = [torch.full((len(t) - p,), self.weight) for t, p in zip(batch.token_ids, batch.prompt_lens)]
        return type("Out", (), {"logprobs": lps})()


class FakeSampler:
    def __init__(self):
        self.drawn = 0

    def next_batch(self, n):
        self.drawn += n
        return list(range(n))

    def state_dict(self):
        return {"drawn": self.drawn}


def _rollout(step: int) -> ScoredRollout:
    samples = [Sample(f"p{step}", i, [1, 2], [3, 4, 5], [-0.5, -0.25, -1.0], "length", 0.0)
               for i in range(2)]
    return ScoredRollout(samples=samples, rewards=[0.0, 1.0], advantages=[-1.0, 1.0],
                         metrics={"reward/mean": 0.5}, group_rewards={f"p{step}": [0.0, 1.0]},
                         num_prompts_drawn=1)


def _prepare_with(learner, calls=None):
    """What the loop's prepare returns, reduced to its pi_old: one mini-batch; the learner's
    log-probs (under whatever weights it holds now), or the saved ones from a checkpoint."""

    def prepare(rollout, saved):
        if calls is not None:
            calls.append(saved is not None)
        if saved is not None:
            lps = saved[0]
        else:
            batch = SimpleNamespace(token_ids=[s.prompt_token_ids + s.response_token_ids
                                               for s in rollout.samples],
                                    prompt_lens=[len(s.prompt_token_ids) for s in rollout.samples])
            lps = learner.compute_logprobs(batch).logprobs
        return SimpleNamespace(old=SimpleNamespace(mini_batches=[SimpleNamespace(old_logprobs=lps)]))

    return prepare


def _lps(ready):
    return [t.tolist() for t in ready.prepared.old.mini_batches[0].old_logprobs]


def _pipeline(produce, learner, overlap, learner_logprobs=False, is_main=True, calls=None):
    return _step_schedule(produce, _prepare_with(learner, calls), learner, FakeSampler(),
                           is_main=is_main, world_size=1, overlap=overlap,
                           learner_logprobs=learner_logprobs)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_wait_cut_by_the_deadline_drops_the_step_and_keeps_the_data_position(overlap):
    """Issue 49: StepAbandoned raised in the main rank's wait (by the preemption flag's
    deadline rule) comes out of ``take`` as StepAbandoned (through the broadcast marker);
    the checkpoint of the state before the step holds nothing pending and the sampler as it
    was before the dropped step drew its prompts."""
    from contextlib import contextmanager

    from gspo_megatron.trainer.preemption import StepAbandoned

    cut = threading.Event()

    @contextmanager
    def abandonable():
        yield
        if cut.is_set():
            raise StepAbandoned("no room for the step")

    def produce(step):
        pipe.sampler.next_batch(1)  # the rollout draws its prompts
        return _rollout(step)

    pipe = _step_schedule(produce, _prepare_with(FakeLearner()), FakeLearner(), FakeSampler(),
                           is_main=True, world_size=1, overlap=overlap, learner_logprobs=False,
                           abandonable=abandonable)
    pipe.submit(1, trained_steps=0)
    assert pipe.take(1).rollout.samples[0].prompt_id == "p1"  # nothing cut: as before
    pipe.submit(2, trained_steps=1)
    cut.set()
    with pytest.raises(StepAbandoned, match="no room for the step"):
        pipe.take(2)
    assert pipe.sampler.drawn == 2
    assert pipe.abandon_state() == (None, {"drawn": 1})
    pipe.close()


def test_on_policy_produces_at_take_time():
    calls = []
    pipe = _pipeline(lambda s: calls.append(s) or _rollout(s), FakeLearner(), overlap=False)
    assert not pipe.has(1)
    pipe.submit(1, trained_steps=0)
    assert pipe.has(1) and calls == []  # nothing runs before take()
    ready = pipe.take(1)
    assert calls == [1] and ready.policy_lag == 0 and ready.rollout.samples[0].prompt_id == "p1"
    with pytest.raises(RuntimeError, match="take\\(2\\)"):
        pipe.take(2)


def test_overlap_generates_in_the_background():
    started, release = threading.Event(), threading.Event()

    def produce(step):
        started.set()
        assert release.wait(10)
        return _rollout(step)

    pipe = _pipeline(produce, FakeLearner(), overlap=True)
    pipe.submit(2, trained_steps=0)
    assert started.wait(10)  # generating while this thread goes on ("training")
    with pytest.raises(RuntimeError, match="still pending"):
        pipe.submit(3, trained_steps=0)
    release.set()
    ready = pipe.take(2)
    assert ready.policy_lag == 1 and len(ready.rollout.samples) == 2


def test_background_error_is_raised_by_take():
    def produce(step):
        raise ValueError("engine died")

    pipe = _pipeline(produce, FakeLearner(), overlap=True)
    pipe.submit(1, trained_steps=0)
    with pytest.raises(ValueError, match="engine died"):
        pipe.take(1)


def test_learner_logprobs_use_the_generating_weights():
    learner = FakeLearner()
    learner.update(0.5)
    pipe = _pipeline(_rollout, learner, overlap=True, learner_logprobs=True)
    pipe.submit(2, trained_steps=1)  # the engine now has weight 0.5
    learner.update(0.75)  # the learner trains meanwhile
    ready = pipe.take(2)
    assert _lps(ready) == [[0.5, 0.5, 0.5]] * 2
    assert learner.weight == 0.75  # the current weights came back
    # on-policy: the current weights are the generating ones
    on = _pipeline(_rollout, learner, overlap=False, learner_logprobs=True)
    on.submit(3, trained_steps=2)
    assert _lps(on.take(3))[0] == [0.75] * 3


def test_in_flight_rollout_survives_a_checkpoint():
    learner = FakeLearner()
    pipe = _pipeline(_rollout, learner, overlap=True, learner_logprobs=True)
    assert pipe.checkpoint_state() is None
    pipe.submit(4, trained_steps=2)
    learner.update(2.0)
    state = pipe.checkpoint_state()
    assert state["step"] == 4 and state["old_logprobs"] == [[[0.0] * 3] * 2]  # per mini-batch
    learner.update(3.0)  # the snapshot is gone after a restart: the saved values must be used
    calls = []
    resumed = _pipeline(_rollout, learner, overlap=True, learner_logprobs=True, calls=calls)
    resumed.restore(state)
    assert resumed.has(4)
    a, b = pipe.take(4), resumed.take(4)
    assert calls == [True]  # prepared from the saved pi_old, not a pass under the new weights
    assert a.rollout == b.rollout and a.policy_lag == b.policy_lag == 1
    assert _lps(a) == _lps(b) == [[0.0] * 3] * 2


def test_restored_rollout_does_not_advance_other_ranks_samplers():
    learner = FakeLearner()
    other = _pipeline(None, learner, overlap=True, is_main=False)
    other.submit(1, trained_steps=0)
    state = {"step": 1, "version": 0, "rollout": dataclasses.asdict(_rollout(1)),
             "old_logprobs": None}
    fresh = _pipeline(None, learner, overlap=True, is_main=False)
    fresh.restore(state)
    fresh.take(1)
    assert fresh.sampler.drawn == 0  # the saved sampler state already counts these prompts
    original = rp.broadcast_from_main
    rp.broadcast_from_main = lambda obj, world_size: _rollout(1)  # what rank 0 would send
    try:
        other.take(1)
    finally:
        rp.broadcast_from_main = original
    assert other.sampler.drawn == 1


def test_weights_swapped_in_restores_on_error():
    learner = FakeLearner()
    learner.update(1.0)
    snap = WeightSnapshot.take(learner)
    learner.update(2.0)
    with pytest.raises(KeyError):
        with weights_swapped_in(learner, snap):
            assert learner.weight == 1.0
            raise KeyError("boom")
    assert learner.weight == 2.0
    with pytest.raises(ValueError, match="another model"):
        with weights_swapped_in(learner, WeightSnapshot(step=-1, tensors=[])):
            pass


def test_a_background_rollout_past_its_deadline_is_named_not_waited_for():
    """Issue 41: the take of an overlapped step waits at most the engine's stall deadline."""
    import threading

    from gspo_megatron.trainer.schedule.stepwise import RolloutTimeout, _Background

    release = threading.Event()
    job = _Background(lambda: release.wait(10) and "done", name="rollout-7")
    try:
        with pytest.raises(RolloutTimeout, match="rollout-7 did not finish within 0.2s"):
            job.result(timeout_s=0.2)
    finally:
        release.set()
    assert job.result(timeout_s=5) == "done"


def test_wait_idle_on_a_wedged_background_rollout_ends_at_its_deadline(caplog):
    """Issue 41 item 3: ``wait_idle`` (before an evaluation, a serial probe step, the run's end)
    waits at most the engine's stall deadline, then names the rollout and the deadline; ``close``
    after an error logs it instead of raising it over the run's own error."""
    release = threading.Event()

    def produce(step):
        assert release.wait(30)
        return _rollout(step)

    pipe = _step_schedule(produce, _prepare_with(FakeLearner()), FakeLearner(), FakeSampler(),
                           is_main=True, world_size=1, overlap=True, learner_logprobs=False,
                           wait_timeout_s=0.5)
    pipe.submit(3, trained_steps=1)
    try:
        t0 = time.monotonic()
        with pytest.raises(rp.RolloutTimeout, match=r"rollout-3 did not finish within 0\.5s"):
            pipe.wait_idle()
        assert 0.5 <= time.monotonic() - t0 < 5
        pipe.close()  # logged, not raised
        assert "rollout-3 did not finish within 0.5s" in caplog.text
    finally:
        release.set()
    pipe.wait_idle()  # it finished once released: the result is kept for take
    assert pipe.take(3).policy_lag == 1


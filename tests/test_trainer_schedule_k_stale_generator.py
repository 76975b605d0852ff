"""The continuous generator's own rules (trainer/schedule/k_stale_generator.py): admission within the
staleness bound, too-old groups dropped and counted, errors and stalls named, and checkpoints
that neither lose nor repeat a prompt.

The engine here is a scripted one: these tests are about the generator's bookkeeping, which
does not depend on how samples are made. The real SGLang server runs the generator in
tests/test_trainer_schedule_k_stale_real_sglang.py.
"""

from __future__ import annotations

import threading
import time
from typing import List

import pytest

from gspo_megatron.data.records import PromptRecord
from gspo_megatron.data.sampler import PromptSampler
from gspo_megatron.rollout.types import Sample, SamplingParams
from gspo_megatron.trainer.schedule.k_stale_generator import (AsyncGenerator, FinishedGroup,
                                                              GeneratorFailed, group_seed)

N = 2


class ScriptedEngine:
    """Answers each group with ``N`` samples of the current version; can hold answers back."""

    def __init__(self) -> None:
        self.version = 0
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()
        self.running = 0
        self.max_running = 0
        self.seeds: List[int] = []
        self.fail_on = None
        self.hold = {}
        """prompt id prefix -> Event: that group answers only once it is set."""

    def generate(self, requests, params):
        (req,) = requests
        v = self.version  # its tokens start with the weights served when it was sent
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            self.seeds.append(params.seed)
        try:
            if not self.gate.wait(timeout=20):
                raise RuntimeError("gate never opened")
            for prefix, event in self.hold.items():
                if req.prompt_id.startswith(prefix) and not event.wait(timeout=20):
                    raise RuntimeError("held group never released")
            if self.fail_on is not None and req.prompt_id.startswith(self.fail_on):
                raise RuntimeError("server exploded")
            return [Sample(req.prompt_id, i, list(req.prompt_token_ids), [5, 6, 7], [-1.0] * 3,
                           "stop", 0.0, weight_version=str(v), token_versions=[v] * 3)
                    for i in range(req.n)]
        finally:
            with self.lock:
                self.running -= 1


def records(num: int) -> List[PromptRecord]:
    return [PromptRecord(f"p{i:03d}", (1, 2, i % 7), f"q{i}", str(i % 2)) for i in range(num)]


def make(engine, *, num=40, k=2, per_step=3, in_flight=3, score=None, drop=False, wait=10.0):
    sampler = PromptSampler(records(num), seed=0, shuffle=False)
    score = score or (lambda samples, record: [float(s.sample_index) for s in samples])
    return AsyncGenerator(engine, sampler, score, SamplingParams(max_new_tokens=4), n=N,
                          groups_per_step=per_step, max_staleness=k, groups_in_flight=in_flight,
                          run_seed=3, advantage_mode="group_norm", advantage_eps=1e-6,
                          drop_zero_variance=drop, wait_timeout_s=wait)


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_admission_stops_at_k_plus_one_batches_and_the_in_flight_cap():
    engine = ScriptedEngine()
    engine.gate.clear()  # the engine holds every request: concurrency builds up to the cap
    gen = make(engine, k=2, per_step=3, in_flight=4)
    try:
        gen.start()
        wait_for(lambda: engine.running == 4)
        time.sleep(0.3)  # a fifth would have been sent by now
        assert engine.running == 4 and gen.gauges()["in_flight_groups"] == 4
        engine.gate.set()
        # nobody takes: (k + 1) * B = 9 groups are admitted, then admission waits
        wait_for(lambda: gen.gauges()["buffer_groups"] == 9)
        time.sleep(0.3)
        assert gen.gauges()["buffer_groups"] == 9 and gen.gauges()["in_flight_groups"] == 0
        assert engine.max_running == 4
        groups, _ = gen.take(lambda v: 0)
        assert len({g.index for g in groups}) == 3 and all(g.index < 9 for g in groups)
        time.sleep(0.3)  # no room until the weights after this batch's update are synced
        assert gen._admitted == 9 and gen.gauges()["buffer_groups"] == 6
        gen.synced(engine.version)
        wait_for(lambda: gen.gauges()["buffer_groups"] == 9)  # room for exactly 3 more
        time.sleep(0.3)
        assert gen._admitted == 12
    finally:
        gen.close()


def test_groups_older_than_k_are_dropped_and_counted():
    engine = ScriptedEngine()
    gen = make(engine, k=2, per_step=2, in_flight=2)
    try:
        gen.start()
        wait_for(lambda: gen.gauges()["buffer_groups"] == 6)
        # every buffered group is of version 0; pretend version 0 is 3 RL steps old
        engine.version = 9
        groups, _ = gen.take(lambda v: 3 if v == 0 else 0)
        assert all(g.oldest_version == 9 for g in groups)
        assert gen.gauges()["dropped_stale_groups"] == 6
    finally:
        gen.close()


def test_seeds_follow_the_admission_index_and_advantages_are_group_normalised():
    engine = ScriptedEngine()
    gen = make(engine, k=2, per_step=2, in_flight=1)
    try:
        gen.start()
        groups, _ = gen.take(lambda v: 0)
        assert sorted(engine.seeds)[:2] == sorted(group_seed(3, i) for i in (0, 1))
        for g in groups:
            assert g.rewards == [0.0, 1.0]
            assert g.advantages[0] < 0 < g.advantages[1]
            assert [s.prompt_id for s in g.samples] == [g.record.prompt_id] * N
    finally:
        gen.close()


def test_equal_rewards_are_dropped_under_dynamic_sampling():
    engine = ScriptedEngine()
    gen = make(engine, score=lambda samples, record: [1.0] * len(samples)
               if record.prompt_id in ("p000", "p002") else [0.0, 1.0], drop=True)
    try:
        gen.start()
        groups, _ = gen.take(lambda v: 0)
        assert "p000" not in [g.record.prompt_id for g in groups]
        assert gen.gauges()["dropped_zero_variance_groups"] >= 1
    finally:
        gen.close()


def test_an_engine_error_ends_take_naming_the_prompt():
    engine = ScriptedEngine()
    engine.fail_on = "p001"
    gen = make(engine)
    try:
        gen.start()
        with pytest.raises(GeneratorFailed, match=r"'p001'.*server exploded"):
            for _ in range(5):
                gen.take(lambda v: 0)
                gen.synced(engine.version)
    finally:
        gen.close()


def test_a_stalled_engine_ends_take_after_its_deadline():
    engine = ScriptedEngine()
    engine.gate.clear()
    gen = make(engine, wait=0.5)
    try:
        gen.start()
        t0 = time.monotonic()
        with pytest.raises(GeneratorFailed, match="no prompt group finished in 0s|stalled"):
            gen.take(lambda v: 0)
        assert time.monotonic() - t0 < 5
    finally:
        engine.gate.set()
        gen.close()


def test_a_resumed_generator_neither_loses_nor_repeats_a_prompt():
    engine = ScriptedEngine()
    gen = make(engine, k=2, per_step=3, in_flight=3)
    taken: List[str] = []
    try:
        gen.start()
        taken += [g.record.prompt_id for g in gen.take(lambda v: 0)[0]]
        gen.synced(engine.version)
        # quiescent: (k + 1) B = 9 groups finished, none in flight, no room to admit
        wait_for(lambda: gen.gauges()["buffer_groups"] == 9)
        taken += [g.record.prompt_id for g in gen.take(lambda v: 0)[0]]
        engine.gate.clear()  # the sync makes room for 3: they stay in flight
        gen.synced(engine.version)
        wait_for(lambda: gen.gauges()["in_flight_groups"] == 3)
        state = gen.snapshot()
        assert len(state["in_flight"]) == 3
        assert len(state["buffer"]) + len(state["in_flight"]) + len(taken) == state["admitted"]
    finally:
        engine.gate.set()
        gen.close()
    saved_buffer = [g["record"]["prompt_id"] for g in state["buffer"]]
    saved_flight = [r["prompt_id"] for _, r in state["in_flight"]]
    assert (len(taken), len(saved_buffer), len(saved_flight)) == (6, 6, 3)

    engine2 = ScriptedEngine()
    resumed = make(engine2, k=2, per_step=3, in_flight=3)
    resumed.restore(state)
    assert resumed.counters["discarded_in_flight_groups"] == 3
    try:
        resumed.start()
        after: List[str] = []
        while len(after) < 15:
            after += [g.record.prompt_id for g in resumed.take(lambda v: 0)[0]]
            resumed.synced(engine2.version)
    finally:
        resumed.close()
    # the buffer's groups come first (oldest admission first: the 3 in flight were admitted
    # last), the re-generated ones are there, nothing twice, no gap
    assert set(after[:len(saved_buffer)]) == set(saved_buffer)
    assert set(saved_flight) <= set(after)
    everything = taken + after
    assert len(everything) == len(set(everything))  # nothing twice
    # nothing lost: every prompt the snapshot had admitted trained, before or after the resume
    assert {f"p{i:03d}" for i in range(state["admitted"])} <= set(everything)
    # and the resumed run drew on from where the snapshot's sampler stood
    assert min(set(after) - set(saved_buffer) - set(saved_flight)) == f"p{state['admitted']:03d}"
    # a re-generated group keeps its admission seed
    flight_indices = [i for i, _ in state["in_flight"]]
    assert {group_seed(3, i) for i in flight_indices} <= set(engine2.seeds)


def test_a_slow_group_at_its_last_chance_is_waited_for_not_dropped():
    """The bound is kept by waiting: the long response admitted k steps ago trains this step
    (dropping it would bias every batch towards short responses)."""
    engine = ScriptedEngine()
    slow = threading.Event()
    engine.hold = {"p000": slow}
    gen = make(engine, k=2, per_step=3, in_flight=3)
    trained = {"steps": 0}
    lag_of = lambda v: trained["steps"] - v  # noqa: E731  (version = RL step here)
    try:
        gen.synced(0)
        gen.start()
        taken: List[str] = []
        for step in (1, 2):  # p000 is young: younger finished groups may go first
            taken += [g.record.prompt_id for g in gen.take(lag_of)[0]]
            trained["steps"] = step
            engine.version = step
            gen.synced(step)
        assert "p000" not in taken
        done = {}
        waiter = threading.Thread(target=lambda: done.setdefault("groups", gen.take(lag_of)[0]))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive(), "step 3 took younger groups while p000 was due"
        slow.set()
        waiter.join(timeout=10)
        assert [g.record.prompt_id for g in done["groups"]][0] == "p000"
        assert gen.gauges()["dropped_stale_groups"] == 0
    finally:
        slow.set()
        gen.close()


class DueNowOnly(AsyncGenerator):
    """The rule before issue 51: wait only for the groups whose last chance is this step."""

    def _short_of(self, lag_of):
        return sum(1 for v in self._admitted_at.values()
                   if v is not None and lag_of(v) >= self.max_staleness)


@pytest.mark.parametrize("rule, dropped", [(AsyncGenerator, 0), (DueNowOnly, 2)],
                         ids=["earliest_deadline_first", "broken_due_now_only"])
def test_a_slow_cohort_larger_than_a_batch_is_waited_for_a_step_ahead(rule, dropped):
    """Issue 51 item 2: k = 2, B = 2, and the four slowest of the six groups admitted at
    start-up (one version) outnumber a batch. At step 2 two of them must be taken, or at step 3
    four are due at once and two are dropped: earliest deadline first waits for them at step 2;
    the old rule (the broken variant) takes the younger finished groups and drops two."""
    engine = ScriptedEngine()
    slow = threading.Event()
    engine.hold = {f"p00{i}": slow for i in range(4)}
    sampler = PromptSampler(records(40), seed=0, shuffle=False)
    gen = rule(engine, sampler, lambda samples, record: [float(s.sample_index) for s in samples],
               SamplingParams(max_new_tokens=4), n=N, groups_per_step=2, max_staleness=2,
               groups_in_flight=6, run_seed=3, advantage_mode="group_norm", advantage_eps=1e-6,
               drop_zero_variance=False, wait_timeout_s=10.0)
    trained = {"steps": 0}
    lag_of = lambda v: trained["steps"] - v  # noqa: E731  (version = RL step here)
    taken: List[List[str]] = []

    def step(n: int) -> None:
        trained["steps"] = n - 1
        done = {}
        waiter = threading.Thread(target=lambda: done.setdefault("groups", gen.take(lag_of)[0]))
        waiter.start()
        waiter.join(timeout=0.5)
        if waiter.is_alive():  # waiting for the slow cohort: let it finish
            taken.append(["waited"])
            slow.set()
            waiter.join(timeout=10)
        taken.append(sorted(g.record.prompt_id for g in done["groups"]))
        engine.version = n
        gen.synced(n)

    try:
        gen.synced(0)
        gen.start()
        wait_for(lambda: gen.gauges()["buffer_groups"] == 2)  # p004, p005; p000-p003 held
        for n in (1, 2, 3, 4):
            step(n)
        slow_taken = [p for batch in taken for p in batch if p < "p004"]
        assert gen.gauges()["dropped_stale_groups"] == dropped
        assert taken[0] == ["p004", "p005"]
        if dropped == 0:
            assert taken[1] == ["waited"] and all(p < "p004" for p in taken[2])  # 2 of the 4
            assert sorted(slow_taken) == ["p000", "p001", "p002", "p003"]
        else:
            assert len(slow_taken) == 2
    finally:
        slow.set()
        gen.close()


@pytest.mark.parametrize("finished, in_flight, short", [
    ([2, 2], [1, 1, 1, 1], 2),        # the slow cohort: two of it belong in this batch
    ([1, 2, 2], [1, 2, 2, 2, 2, 2], 0),  # B = 3 below: the slow group can wait a step
    ([0, 0, 0], [0], 0),              # more due now than a batch: the batch is full of them
    ([2, 2], [0], 1),                 # the last chance of a group in flight: wait for it
    ([], [], 0),
])
def test_the_shortfall_counts_what_the_next_steps_cannot_take(finished, in_flight, short):
    """``_short_of`` on hand-made states (slack = k - lag; here a version is its lag): the
    groups of this batch that must come from those still generating."""
    per_step = 3 if len(in_flight) == 6 else 2
    gen = make(ScriptedEngine(), k=2, per_step=per_step, in_flight=8)
    k = gen.max_staleness
    gen._buffer = [FinishedGroup(i, records(1)[0], [], [], [], k - d)
                   for i, d in enumerate(finished)]
    gen._admitted_at = {100 + i: k - d for i, d in enumerate(in_flight)}
    assert gen._short_of(lambda v: v) == short


def test_groups_of_a_dropped_step_are_put_back_first_in_line():
    """A step dropped for the job's deadline after its take (trainer/preemption.py): its
    groups go back to the buffer, ahead of the others, and a snapshot (the checkpoint) holds
    them, so the resumed run trains them and nothing is lost."""
    engine = ScriptedEngine()
    gen = make(engine, k=2, per_step=2, in_flight=2)
    lag_of = lambda v: 0  # noqa: E731
    try:
        gen.synced(0)
        gen.start()
        taken, _ = gen.take(lag_of)
        indices = [g.index for g in taken]
        assert not {g["index"] for g in gen.snapshot()["buffer"]} & set(indices)
        gen.put_back(taken)
        assert [g["index"] for g in gen.snapshot()["buffer"]][:2] == indices
        again, _ = gen.take(lag_of)
        assert [g.index for g in again] == indices
    finally:
        gen.close()


def test_groups_in_flight_default_to_the_clients_concurrency_cap():
    from gspo_megatron.config.load import load_config
    from gspo_megatron.trainer.schedule.k_stale import groups_in_flight

    base = ["rollout.max_staleness=2", "rollout.engine=reference", "rollout.mode=disaggregated"]
    cfg = load_config(None, [*base, "rollout.n_samples_per_prompt=8",
                             "rollout.sglang.max_concurrency_per_server=64"])
    assert groups_in_flight(cfg) == 8  # 64 requests: what an on-policy batch sends at once
    cfg = load_config(None, [*base, "rollout.n_samples_per_prompt=6", "rollout.sglang.num_servers=2",
                             "rollout.sglang.max_concurrency_per_server=16"])
    assert groups_in_flight(cfg) == 6  # ceil(32 / 6)
    cfg = load_config(None, [*base, "rollout.async_groups_in_flight=3"])
    assert groups_in_flight(cfg) == 3

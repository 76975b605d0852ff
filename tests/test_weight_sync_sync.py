"""Tests of the one weight-update loop (weight_sync/sync.py) with a recording engine and transport."""

import pytest
import torch

from gspo_megatron.rollout.types import RolloutEngine
from gspo_megatron.weight_sync.buckets import iter_buckets
from gspo_megatron.weight_sync.sync import BucketTransport, Coordinator, run_update


class Recorder(RolloutEngine):
    def __init__(self, fail_begin=False):
        super().__init__()
        self.calls, self.fail_begin = [], fail_begin

    def _generate(self, requests, params):
        return []

    def health(self):
        return True

    def begin_weight_update(self, session=True):
        self.calls.append(("begin", session))
        if self.fail_begin:
            raise RuntimeError("server refused /begin_weight_update")
        return ["a:1", "b:1"]

    def finish_weight_update(self, weight_version):
        self.calls.append(("finish", weight_version))
        return {"weight_sync/pause_s": 0.1}

    def cancel_weight_update(self):
        self.calls.append(("cancel",))


class Sink(BucketTransport):
    session = False

    def __init__(self, engine, fail_at=None):
        super().__init__(engine, bucket_bytes=64)
        self.fail_at = fail_at

    def connect(self, members):
        self.engine.calls.append(("connect", tuple(members)))

    def send_bucket(self, bucket, weight_version=None):
        if self.fail_at == len([c for c in self.engine.calls if c[0] == "bucket"]):
            raise ConnectionError("server died mid-bucket")
        self.engine.calls.append(("bucket", tuple(bucket.names), weight_version))

    def finish(self, weight_version):
        self.engine.calls.append(("finish_transport", weight_version))


TENSORS = [(f"w{i}", torch.zeros(8)) for i in range(5)]  # 32 bytes each -> buckets of 2


def test_the_loop_runs_the_protocol_around_the_buckets():
    eng = Recorder()
    sink = Sink(eng)
    eng.attach_weight_transport(sink)
    stats = eng.update_weights(iter(TENSORS), "v1")
    assert eng.calls == [("begin", False), ("connect", ("a:1", "b:1")),
                         ("bucket", ("w0", "w1"), "v1"), ("bucket", ("w2", "w3"), "v1"),
                         ("bucket", ("w4",), "v1"), ("finish_transport", "v1"), ("finish", "v1")]
    assert (stats.num_buckets, stats.num_tensors, stats.num_bytes) == (3, 5, 160)
    assert stats.phases["weight_sync/pause_s"] == 0.1 and "weight_sync/transfer_s" in stats.phases
    eng.calls.clear()
    eng.update_weights(iter(TENSORS[:1]), "v2")
    assert ("connect", ("a:1", "b:1")) not in eng.calls  # same members: no reconnect


def test_a_failed_transfer_is_cancelled_on_the_servers_and_reraised():
    eng = Recorder()
    eng.attach_weight_transport(Sink(eng, fail_at=1))
    with pytest.raises(ConnectionError, match="mid-bucket"):
        eng.update_weights(iter(TENSORS), "v1")
    assert eng.calls[-1] == ("cancel",) and ("finish", "v1") not in eng.calls


class TwoRanks(Coordinator):
    """The non-main rank's view: the main rank's begin failed."""

    is_main = False
    is_sender = True

    def broadcast(self, obj):
        return (None, "RuntimeError: server refused /begin_weight_update")


def test_a_refused_begin_stops_every_rank():
    eng = Recorder(fail_begin=True)
    with pytest.raises(RuntimeError, match="refused /begin_weight_update"):
        run_update(eng, Sink(eng), iter_buckets(iter(TENSORS), 64), "v1", Coordinator())
    assert eng.calls == [("begin", False)]  # nothing sent, nothing to cancel
    with pytest.raises(RuntimeError, match="refused on the main rank"):
        run_update(None, Sink(Recorder()), iter([]), "v1", TwoRanks())


@pytest.mark.parametrize("reason, wrapped", [
    ("refused", True), ("timeout", True), ("unavailable", True), ("auth", False)])
def test_a_lost_bucket_is_named_cancelled_and_ends_the_job_with_exit_5(reason, wrapped):
    """A refusal, a timeout or a dead server inside bucket N: ``BucketFailed`` naming the update,
    the bucket, its tensors and the server's message, after the update was cancelled; gspo-train
    maps it to EXIT_ROLLOUT. A wrong key stays ServerAuthError (a configuration error, exit 2)."""
    import logging

    from gspo_megatron.cli.train import EXIT_CONFIG, EXIT_ROLLOUT, _exit_code
    from gspo_megatron.rollout.sglang import api
    from gspo_megatron.rollout.sglang.client import ServerAuthError, ServerUnavailable
    from gspo_megatron.weight_sync.sync import BucketFailed

    errors = {"refused": api.ServerRefused("b:1", api.UPDATE_FROM_DISTRIBUTED, "no session"),
              "timeout": TimeoutError("bucket broadcast to ['a:1'] did not finish in 5s"),
              "unavailable": ServerUnavailable("b:1/update_weights_from_distributed: timed out"),
              "auth": ServerAuthError("b:1", api.UPDATE_FROM_DISTRIBUTED, 401, True)}

    class Failing(Sink):
        def send_bucket(self, bucket, weight_version=None):
            if len([c for c in self.engine.calls if c[0] == "bucket"]) == 1:
                raise errors[reason]
            super().send_bucket(bucket, weight_version)

    eng = Recorder()
    with pytest.raises(BucketFailed if wrapped else ServerAuthError) as failure:
        run_update(eng, Failing(eng), iter_buckets(TENSORS, 64), "v7", Coordinator())
    assert eng.calls[-1] == ("cancel",)
    code = _exit_code(failure.value, None, logging.getLogger("test"))
    if wrapped:
        assert str(failure.value).startswith("weight update v7: bucket 2 (2 tensors, 0.0 MiB: w2 .. w3) "
                                             f"failed: {type(errors[reason]).__name__}: ")
        assert failure.value.index == 2 and failure.value.reason is errors[reason]
        assert code == EXIT_ROLLOUT
    else:
        assert code == EXIT_CONFIG


def test_a_server_lost_mid_update_drains_the_gather_then_every_rank_learns_it():
    """A dead server inside bucket 2 of 3: nothing more is sent, but every bucket is still drawn
    from the gather (a collective: the other ranks are inside it), the update is cancelled and
    ``MemberLost`` (a ``BucketFailed``) is raised so that the caller sends it again; the next
    update re-forms the group. A refusal is no loss: it stays a plain ``BucketFailed``."""
    from gspo_megatron.rollout.sglang import api
    from gspo_megatron.rollout.sglang.client import ServerUnavailable
    from gspo_megatron.weight_sync.sync import BucketFailed, MemberLost

    drawn = []

    def gather():
        for bucket in iter_buckets(TENSORS, 64):
            drawn.append(bucket.names)
            yield bucket

    class DiesOnce(Sink):
        error = ServerUnavailable("b:1/update_weights_from_distributed: connection refused")

        def send_bucket(self, bucket, weight_version=None):
            if weight_version == "v1" and len([c for c in self.engine.calls if c[0] == "bucket"]) == 1:
                raise self.error
            super().send_bucket(bucket, weight_version)

    eng = Recorder()
    sink, coord = DiesOnce(eng), Coordinator()
    with pytest.raises(MemberLost, match=r"weight update v1: bucket 2 .* ServerUnavailable") as lost:
        run_update(eng, sink, gather(), "v1", coord)
    assert lost.value.index == 2 and isinstance(lost.value.reason, ServerUnavailable)
    assert len(drawn) == 3 and [c[0] for c in eng.calls] == ["begin", "connect", "bucket", "cancel"]
    assert coord.last_members is None  # re-formed at the next update
    eng.calls.clear()
    run_update(eng, sink, iter_buckets(TENSORS, 64), "v2", coord)
    assert [c[0] for c in eng.calls] == ["begin", "connect", "bucket", "bucket", "bucket", "finish_transport",
                                         "finish"]

    sink.error = api.ServerRefused("b:1", api.UPDATE_FROM_DISTRIBUTED, "no session")
    eng.calls.clear()
    with pytest.raises(BucketFailed) as refused:
        run_update(eng, sink, iter_buckets(TENSORS, 64), "v1", coord)
    assert not isinstance(refused.value, MemberLost)


def test_the_learners_sync_sends_again_after_a_lost_member_within_its_attempts(monkeypatch):
    from gspo_megatron.weight_sync.learner_sync import LearnerWeightSync
    from gspo_megatron.rollout.types import WeightSyncStats
    from gspo_megatron.weight_sync.sync import MemberLost

    sync = LearnerWeightSync(learner=None, engine=None, transport=None, dst="rank0", bucket_bytes=64,
                             max_attempts=3)
    sync._coord = Coordinator()
    outcomes = [MemberLost("weight update v1: bucket 1 ...", "v1", 1, None)] * 2 + [WeightSyncStats()]
    calls = []

    def update(version, coord):
        calls.append(version)
        outcome = outcomes[len(calls) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(sync, "_update", update)
    assert sync("v1")["weight_sync/attempts"] == 3.0 and calls == ["v1"] * 3
    calls.clear()
    outcomes[2] = outcomes[0]
    with pytest.raises(MemberLost):
        sync("v1")
    assert len(calls) == 3


class Profiled(Sink):
    """A transport that splits its send into two timed parts, as the real ones do."""

    def send_bucket(self, bucket, weight_version=None):
        from gspo_megatron.weight_sync.sync import timed

        with timed(self.profile, "pack"):
            super().send_bucket(bucket, weight_version)
        self.profile["reply"] = self.profile.get("reply", 0.0) + 0.25


def test_each_update_is_profiled_by_phase_and_by_the_transports_own_parts():
    eng = Recorder()
    eng.attach_weight_transport(Profiled(eng))
    first = eng.update_weights(iter(TENSORS), "v1").phases
    for key in ("gather", "check", "send", "finish", "pack", "connect"):
        assert first[f"weight_sync/{key}_s"] >= 0.0, key
    assert first["weight_sync/reply_s"] == 0.75  # 3 buckets, added up
    assert first["weight_sync/send_s"] <= first["weight_sync/transfer_s"]
    second = eng.update_weights(iter(TENSORS[:1]), "v2").phases
    assert second["weight_sync/reply_s"] == 0.25  # reset at every update
    assert "weight_sync/connect_s" not in second  # same members: no group formed

"""A weight update whose Nth bucket one server refuses, made the way SGLang refuses it for real
(its session ended just before that bucket), and what must hold afterwards. Shared by the
stand-in's broadcast tests and the real server's (``test_rollout_sglang_real_server.py``)."""

from __future__ import annotations

import time

import pytest

from gspo_megatron.config.schema import WeightSyncConfig
from gspo_megatron.rollout.sglang.client import SGLangServerClient
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.weight_sync import build_transport
from gspo_megatron.weight_sync.sync import BucketFailed


def broadcast_updates(eng, engine_kind: str, first_seed: int):
    """A gloo broadcast transport on ``eng`` (48 KiB buckets) and ``update(version)``, which
    sends a new random tiny policy's weights and returns that policy."""
    transport = build_transport(WeightSyncConfig(transport="nccl", bucket_bytes=48 * 1024), eng,
                                engine_kind, mode="disaggregated", master_address="127.0.0.1")
    seeds = iter(range(first_seed, first_seed + 100))

    def update(version):
        policy, _ = build_tiny_policy(seed=next(seeds))
        eng.update_weights(((n, t.clone()) for n, t in policy.state_dict().items()), version)
        return policy

    return transport, update


def refuse_bucket_on(transport, client_address: str, index: int):
    """Make the server at ``client_address`` refuse bucket ``index`` of the next update the way
    SGLang refuses it for real: its session is ended just before that bucket is sent."""
    sent = {"n": 0}
    original = transport.send_bucket

    def send_bucket(bucket, weight_version=None):
        sent["n"] += 1
        if sent["n"] == index:
            SGLangServerClient(client_address, 30, 30).end_weight_update()
        return original(bucket, weight_version)

    transport.send_bucket = send_bucket
    return lambda: setattr(transport, "send_bucket", original)


def assert_refused_bucket_ends_cleanly(eng, transport, refuser: str, update, check_weights):
    """Bucket 2 refused by ``refuser``: one error naming both, within a deadline; afterwards every
    server answers, runs no session and generates, and the next update reaches all of them."""
    undo = refuse_bucket_on(transport, refuser, 2)
    start = time.monotonic()
    try:
        with pytest.raises(BucketFailed, match=rf"bucket 2 \(.*{refuser} refused "
                                               r"/update_weights_from_distributed") as failure:
            update("refused")
    finally:
        undo()
    assert time.monotonic() - start < 60 and "still inside the broadcast" not in str(failure.value)
    for client in eng.clients:  # not paused, not in a session, not blocked in the collective
        assert client.health(timeout_s=10), client.address
        client.begin_weight_update()
        client.end_weight_update()
    check_weights(update("after-refusal"))


"""Broadcast-group weight sync to reference servers in other processes (disaggregated mode).

Two reference servers run as processes (``python -m ...reference_server``, request logs on
disk); the test process is group rank 0 and broadcasts bucketed weights over gloo, as a pipeline
stage's first rank does. Checks: bit-identical weights after every update, SGLang's call order,
a refused bucket fails at once (not after the collective's timeout), and a killed server is
skipped by the next update, which re-forms the group without it. One server refusing the Nth
bucket while the other takes it ends the update cleanly: the error names the server and the
bucket, no server stays paused, in a session or inside the broadcast, and the next update works.
"""

import json
import sys
import threading
import time

import pytest
import torch

from gspo_megatron.config.schema import WeightSyncConfig
from gspo_megatron.distributed.ports import free_port
from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.embedded.engine import teacher_forced_logprobs
from gspo_megatron.rollout.sglang.client import SGLangServerClient
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.rollout.sglang.launcher import ServerLauncher
from gspo_megatron.rollout.standin.launcher import reference_server_command
from gspo_megatron.tiny_task.model import build_tiny_policy, save_tiny_model
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams
from gspo_megatron.weight_sync import build_transport
from gspo_megatron.weight_sync.distributed_broadcast import BroadcastTransport
from gspo_megatron.weight_sync.sync import BucketFailed
from tests.weight_sync_faults import assert_refused_bucket_ends_cleanly, broadcast_updates

CHECKED = ("lm_head.weight", "model.layers.0.mlp.experts.3.up_proj.weight",
           "model.layers.1.mlp.gate.weight")


def _calls(path):
    with open(path) as f:
        rows = [json.loads(line)["path"] for line in f]
    out = [p for p in rows if p not in (api.GENERATE, api.HEALTH_GENERATE, api.SERVER_INFO,
                                        api.MODEL_INFO, api.GET_WEIGHTS_BY_NAME)]
    return [p for i, p in enumerate(out) if i == 0 or p != out[i - 1] or p != api.UPDATE_FROM_DISTRIBUTED]


def _check_weights(clients, policy):
    for client in clients:
        for name in CHECKED:
            got = torch.tensor(client.get_weights_by_name(name, 10 ** 6), dtype=torch.float32)
            assert torch.equal(got, policy.state_dict()[name].reshape(-1)), (client.address, name)


@pytest.mark.slow
def test_broadcast_sync_to_server_processes(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    save_tiny_model(*build_tiny_policy(seed=0), str(tmp_path / "m"))
    launcher = ServerLauncher(str(tmp_path / "logs"), env={"OMP_NUM_THREADS": "1"})
    logs = []
    for i in range(2):
        port = free_port()
        logs.append(tmp_path / f"requests{i}.jsonl")
        launcher.start(reference_server_command(str(tmp_path / "m"), port, python=sys.executable,
                                                extra=["--request-log", str(logs[-1])]),
                       f"127.0.0.1:{port}")
    eng = SGLangEngine(launcher.addresses, request_timeout_s=60, launcher=launcher)
    try:
        eng.wait_healthy(timeout_s=180)
        transport = build_transport(WeightSyncConfig(transport="nccl", bucket_bytes=48 * 1024), eng,
                                    "reference", mode="disaggregated", master_address="127.0.0.1")
        assert isinstance(transport, BroadcastTransport) and transport.backend == "gloo"
        for version, seed in (("v1", 5), ("v2", 6)):
            new, tok = build_tiny_policy(seed=seed)
            stats = eng.update_weights(((n, t.clone()) for n, t in new.state_dict().items()), version)
            assert stats.num_buckets > 1 and stats.num_tensors == len(new.state_dict())
            assert transport.world_size == 3
            assert transport.group_name == f"weight_update_group_{transport.incarnation}"
            _check_weights(eng.clients, new)
            samples = eng.generate([GenerationRequest(f"p{i}", tok(t)["input_ids"], n=2)
                                    for i, t in enumerate(["1+2=", "hello"])],
                                   SamplingParams(max_new_tokens=6, seed=4, temperature=0.9))
            for s in samples:
                assert s.weight_version == version
                ref = teacher_forced_logprobs(new, s.prompt_token_ids, s.response_token_ids, 0.9)
                assert torch.allclose(torch.tensor(s.response_logprobs), ref, atol=1e-5)
        cycle = [api.PAUSE, api.BEGIN_UPDATE, api.UPDATE_FROM_DISTRIBUTED, api.END_UPDATE,
                 api.FLUSH_CACHE, api.CONTINUE]
        for log in logs:  # the group is formed once, after the first pause and begin
            assert _calls(log) == cycle[:2] + [api.INIT_GROUP] + cycle[2:] + cycle

        # a refused bucket (no session: SGLang then receives nothing) fails at once, naming it
        with monkeypatch.context() as m:
            m.setattr(SGLangServerClient, "begin_weight_update", lambda self: "")
            start = time.monotonic()
            with pytest.raises(BucketFailed, match=r"weight update v3: bucket 1 \(\d+ tensors.*"
                                                   r"refused /update_weights_from_distributed.*"
                                                   "must run between") as failure:
                eng.update_weights(new.state_dict().items(), "v3")
            assert isinstance(failure.value.reason, api.ServerRefused)
            assert time.monotonic() - start < 30
        eng.update_weights(new.state_dict().items(), "v4")  # the group is re-formed
        _check_weights(eng.clients, new)

        victim = launcher.servers[1].process
        victim.kill()
        victim.wait(timeout=30)
        newer, _ = build_tiny_policy(seed=7)
        stats = eng.update_weights(newer.state_dict().items(), "v5")
        assert stats.phases["weight_sync/num_servers"] == 1.0
        assert stats.phases["weight_sync/num_skipped_servers"] == 1.0
        assert transport.world_size == 2  # re-formed with the survivor only
        _check_weights(eng.clients[:1], newer)
    finally:
        eng.shutdown()
    assert launcher.servers == []


@pytest.mark.leaves_threads("weight-group-rendezvous",
                            reason="rank 0's abandoned rendezvous waits in its TCPStore, which has "
                                   "no abort, until timeout_s (a daemon thread)")
def test_a_server_that_refuses_the_group_fails_the_rendezvous_at_once(tmp_path):
    """The server answers ``/init_weights_update_group`` with a refusal (here: the group name
    exists, as it would for a server still holding a killed trainer's group of the same name):
    rank 0 stops waiting in the store at once with the server's message, not after timeout_s."""
    torch.set_num_threads(1)
    save_tiny_model(*build_tiny_policy(seed=0), str(tmp_path / "m"))
    launcher = ServerLauncher(str(tmp_path / "logs"), env={"OMP_NUM_THREADS": "1"})
    port = free_port()
    launcher.start(reference_server_command(str(tmp_path / "m"), port, python=sys.executable),
                   f"127.0.0.1:{port}")
    eng = SGLangEngine(launcher.addresses, request_timeout_s=60, launcher=launcher)
    first = BroadcastTransport(48 * 1024, master_address="127.0.0.1", backend="gloo", timeout_s=120)
    second = BroadcastTransport(48 * 1024, master_address="127.0.0.1", backend="gloo", timeout_s=120)
    try:
        eng.wait_healthy(timeout_s=180)
        first.connect(launcher.addresses)
        assert first.incarnation != second.incarnation  # the default: no clash at all
        second.incarnation = first.incarnation  # force the clash a fixed name would give
        t0 = time.monotonic()
        with pytest.raises(api.ServerRefused, match=r"init_weights_update_group: .*group name has "
                                                    "already been created"):  # SGLang's words
            second.connect(launcher.addresses)
        assert time.monotonic() - t0 < 10
    finally:
        first.close()
        second.close()
        eng.shutdown()


@pytest.mark.slow
def test_a_server_that_refuses_the_nth_bucket_ends_the_update_cleanly(tmp_path):
    torch.set_num_threads(1)
    save_tiny_model(*build_tiny_policy(seed=0), str(tmp_path / "m"))
    launcher = ServerLauncher(str(tmp_path / "logs"), env={"OMP_NUM_THREADS": "1"})
    for port in (free_port(), free_port()):
        launcher.start(reference_server_command(str(tmp_path / "m"), port, python=sys.executable),
                       f"127.0.0.1:{port}")
    eng = SGLangEngine(launcher.addresses, request_timeout_s=60, launcher=launcher)
    try:
        eng.wait_healthy(timeout_s=180)
        transport, update = broadcast_updates(eng, "reference", first_seed=40)
        update("v1")
        for refuser in launcher.addresses:
            assert_refused_bucket_ends_cleanly(eng, transport, refuser, update,
                                               lambda policy: _check_weights(eng.clients, policy))
        assert all(p.process.poll() is None for p in launcher.servers)
    finally:
        eng.shutdown()


def test_a_killed_trainers_recorded_group_is_destroyed_by_the_next_one(tmp_path, caplog):
    """A trainer killed while its group exists never destroys it, and a server keeps a group
    until told to (SGLang's ``_model_update_group``). With the run's ``record_dir`` the next
    trainer finds the recorded name and destroys that group on the server before forming its own;
    a clean close removes the record. The first transport is abandoned unclosed, as a kill would."""
    torch.set_num_threads(1)
    save_tiny_model(*build_tiny_policy(seed=0), str(tmp_path / "m"))
    launcher = ServerLauncher(str(tmp_path / "logs"), env={"OMP_NUM_THREADS": "1"})
    port = free_port()
    launcher.start(reference_server_command(str(tmp_path / "m"), port, python=sys.executable),
                   f"127.0.0.1:{port}")
    eng = SGLangEngine(launcher.addresses, request_timeout_s=60, launcher=launcher)
    record = tmp_path / "run" / "weight_sync_group.txt"
    dead = BroadcastTransport(48 * 1024, master_address="127.0.0.1", backend="gloo", timeout_s=60,
                              record_dir=str(tmp_path / "run"))
    resumed = BroadcastTransport(48 * 1024, master_address="127.0.0.1", backend="gloo",
                                 timeout_s=60, record_dir=str(tmp_path / "run"))
    client = SGLangServerClient(launcher.addresses[0], 30, 30)
    try:
        eng.wait_healthy(timeout_s=180)
        dead.connect(launcher.addresses)
        assert record.read_text().strip() == dead.group_name
        resumed.connect(launcher.addresses)
        assert f"destroyed weight-update group {dead.group_name}" in caplog.text
        assert record.read_text().strip() == resumed.group_name
        with pytest.raises(api.ServerRefused, match="does not exist"):  # gone from the server
            client.destroy_weights_update_group(dead.group_name)
        resumed.close()
        assert not record.exists()
        with pytest.raises(api.ServerRefused, match="does not exist"):
            client.destroy_weights_update_group(resumed.group_name)
    finally:
        resumed.close()
        dead.close()  # only its process-local half is left (the server refuses, logged)
        eng.shutdown()


class _WedgedPeer:
    """A fake server whose ``/init_weights_update_group`` never answers (``answer=False``) or
    answers success without joining the group (``answer=True``); other calls answer success."""

    def __init__(self, answer: bool) -> None:
        import http.server

        release = self.release = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == api.INIT_GROUP and not answer:
                    release.wait(30)  # wedged until the test ends; the client is gone by then
                    return
                data = b'{"success": true, "message": "ok"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="wedged-peer")
        self.thread.start()

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.mark.parametrize("answer", [False, True], ids=["init_never_answers", "answers_never_joins"])
def test_a_wedged_peer_fails_the_group_at_its_deadline_naming_it(answer):
    """Issue 41 item 3: a server that takes ``/init_weights_update_group`` and never answers, or
    answers without ever joining, ends the group's formation with one error naming it and the
    deadline, within the deadline (3 s here; ``timeout_s``, 600 s by default)."""
    before = set(threading.enumerate())
    peer = _WedgedPeer(answer)
    transport = BroadcastTransport(48 * 1024, master_address="127.0.0.1", backend="gloo",
                                   timeout_s=3.0)
    try:
        t0 = time.monotonic()
        why = "answered but did not join" if answer else "did not answer /init_weights_update_group"
        with pytest.raises(TimeoutError, match=rf"not formed within the deadline of 3s: "
                                               rf"\['{peer.address}'\] {why}"):
            transport.connect([peer.address])
        assert time.monotonic() - t0 < 3.0 + 1.5
    finally:
        transport.close()
        peer.stop()
    deadline = time.monotonic() + 5  # what it started ends by its own deadline (rank 0's store)
    while set(threading.enumerate()) - before:
        assert time.monotonic() < deadline, set(threading.enumerate()) - before
        time.sleep(0.05)

"""Broadcast-group transport (disaggregated mode): each pipeline stage's first rank -> every server.

What SGLang's ``/init_weights_update_group`` + ``/update_weights_from_distributed`` implement
(sglang 0.5.23 ``model_runner_components/weight_updater.py``): the sender (group rank 0) and
each member server's TP ranks (ranks ``1..``, by ``rank_offset``) join one process group (NCCL on
GPU, gloo on CPU). Per bucket, the sender posts the bucket's names / dtypes / shapes to every
member (``load_format="flattened_bucket"``, ``flush_cache=False``) and, while those requests wait,
broadcasts the bucket as one flat uint8 tensor; the servers load it by HF name. Profile
(``weight_sync/<key>_s``): ``pack`` (the bucket made one flat tensor), ``broadcast`` (until the
bytes left this process), ``reply`` (then until every server answered: its load).

With pipeline parallelism every stage's first rank owns one such group (``<group>_pp<stage>``,
rendezvous on its own host, at its address on the route to the servers:
distributed/host_address.py) and sends its stage's buckets itself, as slime does; the groups are
formed and used one stage at a time (weight_sync/sync.py, checkpoint/gather.py), since a server
serves one group call at a time and two stages waiting on each other's servers would deadlock.

Membership: :meth:`connect` is called when the set of live servers changed (a server died or came
back) or a bucket failed: the old group is destroyed on the surviving servers and here, and a new
group is formed under a new name on a fresh port. Lazy NCCL init on both sides: sglang 0.5.23 joins without ``device_id``
(``init_custom_process_group(device_id=None)``); an eager init on one side only would deadlock
the group's creation, so this side does not pass it either.

A killed trainer's group: SGLang keeps every group in a dict by name until
``/destroy_weights_update_group`` (``model_runner_components/weight_updater.py``,
``_model_update_group``), and lists them nowhere. With ``record_dir`` (the trainer passes its run
directory) the name of the group a transport forms is written to ``weight_sync_group[_pp<k>].txt``
before the servers join it and removed when the transport closes; the next trainer of the run
finds a name left there by one that was killed and destroys that group on its servers before
forming its own, so a resumed run leaves no group of its predecessor behind.

Deadlines: forming a group (every ``/init_weights_update_group`` answered and the rendezvous done)
and each bucket (metadata answered, broadcast complete) take at most ``timeout_s``; past it a
``TimeoutError`` names the servers that did not answer or join, and the deadline.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional

import torch

from gspo_megatron.distributed.host_address import update_group_address
from gspo_megatron.distributed.ports import free_port
from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import ServerUnavailable, SGLangServerClient
from gspo_megatron.rollout.sglang.update_group import (broadcast_from_learner, create_update_group,
                                                destroy_update_group)
from gspo_megatron.weight_sync.buckets import Bucket
from gspo_megatron.weight_sync.sync import BucketTransport, timed

log = logging.getLogger(__name__)


def _timed_out(future) -> bool:
    """A finished call that failed by the client's own timeout (the server never answered)."""
    exc = future.exception()
    return isinstance(exc, ServerUnavailable) and exc.timed_out


class BroadcastTransport(BucketTransport):
    """One broadcast group between this process (rank 0) and every member server's TP ranks."""

    dst = "stage"
    checks_server_model = True

    def __init__(self, bucket_bytes: int, server_tp_size: int = 1,
                 master_address: Optional[str] = None, master_port: Optional[int] = None,
                 backend: Optional[str] = None, group_name: str = api.DEFAULT_GROUP_NAME,
                 timeout_s: float = 600.0, engine=None, record_dir: Optional[str] = None) -> None:
        super().__init__(engine, bucket_bytes)
        if server_tp_size < 1:
            raise ValueError(f"server TP size must be >= 1, got {server_tp_size}")
        self.server_tp_size = server_tp_size
        self.master_address = master_address
        """Rendezvous host; None: this host's address on the route to the first member."""
        self._first_port = master_port
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if self.backend == "nccl" else torch.device("cpu")
        self.base_group_name = group_name
        self.timeout_s = timeout_s
        """The longest forming the group, or sending one bucket, may take."""
        self.record_dir = record_dir
        """Where the name of the group on the servers is recorded (None: nowhere)."""
        self.drain_s = 30.0
        """After a refused bucket: how long the members that took it may take to finish."""
        self.group = None
        self.clients: List[SGLangServerClient] = []
        self._pool: Optional[ThreadPoolExecutor] = None
        self._formation = 0
        self.incarnation = secrets.token_hex(4)
        """Random per transport object (per trainer process): a server that outlived a killed
        trainer still holds that trainer's group, and SGLang refuses a second group of the same
        name ("The specified group name has already been created")."""

    @property
    def group_name(self) -> str:
        """``<group>_<incarnation>[_pp<stage>][_<n>]``: the n-th re-formation gets a new name
        (an abandoned group stays registered under the old one in this process)."""
        c = self.coordinator
        name = f"{self.base_group_name}_{self.incarnation}"
        name = name if c.num_stages == 1 else f"{name}_pp{c.stage}"
        return name if self._formation == 0 else f"{name}_{self._formation}"

    @property
    def world_size(self) -> int:
        return 1 + self.server_tp_size * len(self.clients)

    def connect(self, members: List[str]) -> None:
        """(Re)form the group with ``members``; blocks until every server joined, at most
        ``timeout_s`` (then ``TimeoutError`` naming the servers that did not)."""
        if self.clients:
            self._disconnect()
            self._formation += 1
        self.clients = [SGLangServerClient(a, self.timeout_s, self.timeout_s) for a in members]
        if not self.clients:
            raise RuntimeError("no live rollout server to send weights to")
        self._destroy_leftover()
        self._record(self.group_name)  # before the servers join: a kill from here on is covered
        deadline = time.monotonic() + self.timeout_s
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="weight-sync")
        host = update_group_address(self.master_address, members)
        port = self._first_port or free_port(host)
        self._first_port = None  # a re-formed group rendezvous on a fresh port
        payload = lambda i: api.init_group_payload(  # noqa: E731
            host, port, 1 + i * self.server_tp_size, self.world_size,
            self.group_name, self.backend)
        futures = [self._pool.submit(c.init_weights_update_group, payload(i))
                   for i, c in enumerate(self.clients)]
        self.group = self._rendezvous(host, port, futures, deadline)
        while not all(f.done() for f in futures):  # joined; their answers are on the way
            if time.monotonic() > deadline:
                raise self._not_joined(host, port, futures)
            time.sleep(0.01)
        for f in futures:
            f.result()
        log.info("weight broadcast group %s ready: %d servers, world %d (%s)", self.group_name,
                 len(self.clients), self.world_size, self.backend)

    def _rendezvous(self, host: str, port: int, futures, deadline: float):
        """Join the group as rank 0 while the servers join; a server that refuses (its
        ``/init_weights_update_group`` answers first) fails the rendezvous at once with its
        message instead of leaving rank 0 waiting in the store until the deadline."""
        outcome = {}
        # the joining thread uses this thread's GPU (a new thread starts on device 0)
        device = torch.cuda.current_device() if self.backend == "nccl" else None

        def join():
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                outcome["group"] = create_update_group(host, port, 0, self.world_size,
                                                       self.group_name, self.backend,
                                                       self.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - reported to the caller below
                outcome["error"] = exc

        # A daemon thread: an abandoned rendezvous must not keep the process alive at exit.
        joiner = threading.Thread(target=join, name="weight-group-rendezvous", daemon=True)
        joiner.start()
        while joiner.is_alive():
            failed = next((f for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None and not _timed_out(failed):
                raise failed.exception()
            if failed is not None or time.monotonic() > deadline:
                raise self._not_joined(host, port, futures)
            joiner.join(timeout=0.05)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["group"]

    def _not_joined(self, host: str, port: int, futures) -> TimeoutError:
        """The deadline passed: which servers have not answered their init, which answered
        without joining (a server joins before it answers, so those never came)."""
        silent = [c.address for c, f in zip(self.clients, futures)
                  if not f.done() or _timed_out(f)]
        answered = [c.address for c, f in zip(self.clients, futures) if c.address not in silent]
        why = [f"{silent} did not answer {api.INIT_GROUP}"] if silent else []
        why += [f"{answered} answered but did not join"] if answered and self.group is None else []
        return TimeoutError(f"weight group {self.group_name} (rendezvous {host}:{port}) not formed "
                            f"within the deadline of {self.timeout_s:g}s: {'; '.join(why)}")

    # --- the record of our group on the servers (see the module docstring) ------------------
    def _record_path(self) -> Optional[Path]:
        if self.record_dir is None:
            return None
        c = self.coordinator
        return Path(self.record_dir) / ("weight_sync_group.txt" if c.num_stages == 1 else
                                        f"weight_sync_group_pp{c.stage}.txt")

    def _record(self, name: Optional[str]) -> None:
        """Write ``name`` as the group on the servers (None: none, the record goes)."""
        path = self._record_path()
        if path is None:
            return
        if name is None:
            path.unlink(missing_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(name + "\n")
        os.replace(tmp, path)

    def _destroy_leftover(self) -> None:
        """Destroy on every member the group a killed predecessor recorded and never destroyed
        (best effort: a server that never held it refuses, one that is down is skipped)."""
        path = self._record_path()
        name = path.read_text().strip() if path is not None and path.is_file() else ""
        if not name or name.startswith(f"{self.base_group_name}_{self.incarnation}"):
            return  # none, or one of ours (a re-formation destroyed it already)
        for c in self.clients:
            try:
                c.destroy_weights_update_group(name, timeout_s=min(30.0, self.timeout_s))
                log.warning("destroyed weight-update group %s on %s: a previous trainer of this "
                            "run formed it and was killed before it closed it", name, c.address)
            except (ServerUnavailable, api.ServerRefused) as exc:
                log.info("leftover group %s on %s: %s", name, c.address, exc)

    def send_bucket(self, bucket: Bucket, weight_version: Optional[str] = None) -> None:
        """Post the metadata, broadcast the bytes; a server that refuses (it then receives
        nothing, e.g. outside a session) fails the bucket at once with SGLang's message instead
        of leaving the collective waiting for it."""
        body = api.update_distributed_payload(bucket.names, bucket.dtype_names, bucket.shapes,
                                              self.group_name, flush_cache=False,
                                              weight_version=weight_version)
        with timed(self.profile, "pack"):
            flat = bucket.wire_bytes().to(self.device)  # no copy when already one run
        t0 = time.perf_counter()
        futures = [self._pool.submit(c.update_weights_from_distributed, body) for c in self.clients]
        work = broadcast_from_learner(flat, self.group, async_op=True)
        deadline = time.monotonic() + self.timeout_s
        sent_at = None  # profile: the broadcast left here; the rest is the servers' load
        while not (work.is_completed() and all(f.done() for f in futures)):
            if sent_at is None and work.is_completed():
                sent_at = time.perf_counter()
            failed = next((f for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None or time.monotonic() > deadline:
                self._abandon_group()
                stuck = self._drain(futures)
                where = (f"; still inside the broadcast: {stuck} (they leave it when their group "
                         "times out or they restart)" if stuck else "")
                if failed is not None:
                    exc = failed.exception()
                    if stuck and isinstance(exc, api.ServerRefused):
                        raise api.ServerRefused(exc.server, exc.endpoint, exc.message + where) from exc
                    raise exc
                raise TimeoutError(f"bucket broadcast to {[c.address for c in self.clients]} "
                                   f"did not finish in {self.timeout_s}s{where}")
            time.sleep(0.001)
        for f in futures:
            f.result()
        done = time.perf_counter()
        sent_at = done if sent_at is None else sent_at
        self.profile["broadcast"] = self.profile.get("broadcast", 0.0) + sent_at - t0
        self.profile["reply"] = self.profile.get("reply", 0.0) + done - sent_at

    def _drain(self, futures) -> List[str]:
        """After one member refused a bucket the others may be receiving it: give them
        ``drain_s`` to finish (gloo delivers to the ranks that joined; NCCL's ring cannot), so
        that the cancel which follows finds them answering. Returns those still inside."""
        deadline = time.monotonic() + min(self.drain_s, self.timeout_s)
        while time.monotonic() < deadline and not all(f.done() for f in futures):
            time.sleep(0.01)
        return [c.address for c, f in zip(self.clients, futures) if not f.done()]

    def _abandon_group(self) -> None:
        """A collective is left pending: drop the group, re-form a new one next update."""
        self.group = None
        self.coordinator.last_members = None

    def _disconnect(self) -> bool:
        """Destroy the group on the servers (best effort: some may be dead) and here; True when
        every server destroyed it."""
        destroyed = True
        for c in self.clients:
            try:
                c.destroy_weights_update_group(self.group_name)
            except (ServerUnavailable, api.ServerRefused) as exc:
                destroyed = False
                log.warning("destroying group %s on %s: %s", self.group_name, c.address, exc)
        if self.group is not None:
            destroy_update_group(self.group)
        self.group, self.clients = None, []
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        return destroyed

    def close(self) -> None:
        """Destroy the group; its record goes once no server can still hold it."""
        if self.clients and self._disconnect():
            self._record(None)

"""The one weight-update loop: the engine's protocol around buckets, for every transport.

    members = engine.begin_weight_update()     # main rank: pause, abort, (resume weights), begin
    transport.connect(members)                 # senders; stage by stage when membership changed
    for bucket in buckets:                     # every rank (the learner's gather is collective)
        transport.send_bucket(bucket)          # senders only: the one place buckets are moved
    transport.finish(version)                  # main rank (disk: load the written directory)
    engine.finish_weight_update(version)       # main rank: end, flush, continue

Transports (:class:`BucketTransport` subclasses, one module each) only move buckets: in-process
copies, CUDA IPC handles, a broadcast group, safetensors files. :class:`Coordinator` says which
rank does what; :class:`LocalCoordinator` is one process (tests, benchmarks,
``engine.update_weights``), ``learner_sync.DistCoordinator`` a learner world. A failure after
``begin`` cancels the update on the servers (session closed, generation continued) and re-raises.

Profile (the main rank's ``stats.phases``, a few clock reads per bucket): ``weight_sync/gather_s``
(waiting for the next bucket: the learner's gather, unsharding and HF conversion),
``check_s`` (names and shapes against the servers' checkpoint), ``send_s`` (the transport's
``send_bucket``), ``finish_s`` (its ``finish``), ``connect_s`` (forming a group), and the
transport's own split of those (``BucketTransport.profile``: e.g. ``pack_s``, ``reply_s``). With
pipeline stages sending their own buckets, the main rank's numbers cover its own stage.
"""

from __future__ import annotations

import abc
import logging
import time
from contextlib import contextmanager
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, TypeVar

from gspo_megatron.faults import kill_points
from gspo_megatron.rollout.types import NamedTensors, RolloutEngine, WeightSyncStats, WeightTransport
from gspo_megatron.weight_sync.buckets import Bucket, iter_buckets

log = logging.getLogger(__name__)

T = TypeVar("T")


@contextmanager
def timed(totals: Dict[str, float], key: str) -> Iterator[None]:
    """Add the seconds the block takes to ``totals[key]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        totals[key] = totals.get(key, 0.0) + time.perf_counter() - t0


def _timed_iter(items: Iterable[T], totals: Dict[str, float], key: str) -> Iterator[T]:
    """``items``, adding the time spent producing each one to ``totals[key]``."""
    it = iter(items)
    while True:
        with timed(totals, key):
            item = next(it, _END)
        if item is _END:
            return
        yield item


_END = object()


class Coordinator:
    """Which rank does what in one update, and the few collectives between them."""

    is_main = True
    """Holds the engine: runs the protocol calls."""
    is_sender = True
    """Moves buckets into the engine (main rank, or a pipeline stage's first rank)."""
    stage = 0
    num_stages = 1

    def __init__(self) -> None:
        self.last_members: Optional[List[str]] = None

    def broadcast(self, obj):
        """``obj`` from the main rank, on every rank."""
        return obj

    def barrier(self) -> None:
        pass

    def sum(self, values: Sequence[float]) -> List[float]:
        return list(values)


LocalCoordinator = Coordinator


class BucketFailed(RuntimeError):
    """One bucket of a weight update did not arrive (a server refused it, or it timed out). The
    message names the update, the bucket (1-based, its tensors and bytes) and the transport's
    reason (which names the server); the update was cancelled on the servers before this was
    raised, so the job can fail cleanly (``gspo-train`` exit 5)."""

    def __init__(self, weight_version: Optional[str], index: int, bucket: Bucket,
                 reason: BaseException) -> None:
        names = bucket.names
        span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        super().__init__(f"weight update {weight_version}: bucket {index} ({len(names)} tensors, "
                         f"{bucket.num_bytes / 2**20:.1f} MiB: {span}) failed: "
                         f"{type(reason).__name__}: {reason}")
        self.weight_version, self.index, self.reason = weight_version, index, reason


class MemberLost(BucketFailed):
    """A server became unreachable (it died, or stopped answering) while an update was being
    sent to it. The update was carried to its end on every rank without sending (the learner's
    gather is collective), then cancelled on the servers: the caller sends it again, to the
    members left (``LearnerWeightSync``); the lost server leaves the pool at that ``begin``."""

    def __init__(self, message: str, weight_version: Optional[str], index: int,
                 reason: Optional[BaseException]) -> None:
        RuntimeError.__init__(self, message)
        self.weight_version, self.index, self.reason = weight_version, index, reason


def _member_lost(exc: BaseException) -> bool:
    """A failure that a server's death or silence explains (not a refusal: that stays fatal)."""
    from gspo_megatron.rollout.sglang.client import ServerAuthError, ServerUnavailable

    reason = exc.reason if isinstance(exc, BucketFailed) else exc
    return isinstance(reason, (ServerUnavailable, TimeoutError)) and not isinstance(reason, ServerAuthError)


class BucketTransport(WeightTransport):
    """Moves buckets into one engine; the loop and the protocol are :func:`run_update`'s."""

    dst = "rank0"
    """Where the learner's gathered buckets must arrive: ``rank0`` or each ``stage`` leader."""
    session = True
    """Loads tensors inside SGLang's begin/end_weight_update session (disk does not)."""

    def __init__(self, engine: Optional[RolloutEngine], bucket_bytes: int) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"weight_sync.bucket_bytes must be > 0, got {bucket_bytes}")
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.coordinator: Coordinator = LocalCoordinator()
        self._server_models: Dict[str, Optional[object]] = {}
        """First member's address -> its ``ServerModel`` (None: not readable from here)."""
        self.profile: Dict[str, float] = {}
        """Seconds of the current update by sub-phase of ``send_bucket`` / ``finish`` (each
        transport names its own with :func:`timed`); reported as ``weight_sync/<key>_s``."""

    checks_server_model = False
    """Senders check every bucket's names and shapes against the servers' checkpoint before it
    leaves (server transports; ``weight_sync/server_model.py``)."""

    def connect(self, members: List[str]) -> None:
        """Called on senders when the servers to reach changed (and before the first update)."""

    def gather_buffers(self):
        """The buffers the learner's gather receives one update's buckets into
        (``checkpoint.gather.ReusedBuffers``: one per role, reused bucket after bucket)."""
        from gspo_megatron.checkpoint.gather import ReusedBuffers

        return ReusedBuffers()

    def check_bucket(self, bucket: Bucket, members: Optional[List[str]]) -> None:
        """Raise ``PayloadMismatch`` before sending a weight the servers cannot take."""
        if not self.checks_server_model or not members:
            return
        cache = self._server_models
        if members[0] not in cache:
            from gspo_megatron.rollout.sglang.client import SGLangServerClient
            from gspo_megatron.weight_sync.server_model import ServerModel

            cache[members[0]] = ServerModel.from_server(SGLangServerClient(members[0], 60.0, 60.0))
        if cache[members[0]] is not None:
            cache[members[0]].check(zip(bucket.names, bucket.shapes))

    @abc.abstractmethod
    def send_bucket(self, bucket: Bucket, weight_version: Optional[str] = None) -> None:
        """Move one bucket (names, tensors) into the engine's servers / model; servers record
        ``weight_version`` with every bucket (SGLang records it per successful update call)."""

    def finish(self, weight_version: Optional[str]) -> None:
        """After the last bucket, on the main rank."""

    def send(self, named_tensors: NamedTensors, weight_version: Optional[str] = None) -> WeightSyncStats:
        """A whole update from one process (``engine.update_weights``)."""
        return run_update(self.engine, self, iter_buckets(named_tensors, self.bucket_bytes),
                          weight_version, self.coordinator)


def run_update(engine: Optional[RolloutEngine], transport: Optional[BucketTransport],
               buckets: Iterable[Bucket], weight_version: Optional[str],
               coord: Coordinator) -> WeightSyncStats:
    """One weight update (see the module docstring). Collective when ``coord`` spans ranks:
    every rank calls it; ``engine`` is needed on the main rank, ``transport`` on senders."""
    stats = WeightSyncStats()
    t0 = time.perf_counter()
    members, error = None, None
    if coord.is_main:
        try:
            members = engine.begin_weight_update(session=transport.session)
        except Exception as exc:  # every rank must learn that the update will not happen
            error = exc
    members, message = coord.broadcast((members, None if error is None else f"{type(error).__name__}: {error}"))
    if message is not None:
        if error is not None:
            raise error
        raise RuntimeError(f"weight update refused on the main rank: {message}")
    clock: Dict[str, float] = {}
    if transport is not None:
        transport.profile = {}
    try:
        lost = _connect(transport, members, coord, clock)
        t1 = time.perf_counter()
        for index, bucket in enumerate(_timed_iter(buckets, clock, "gather"), start=1):
            if coord.is_sender and lost is None:
                lost = _check_and_send(transport, bucket, members, weight_version, index, clock)
                stats.add_bucket(len(bucket.items), bucket.num_bytes)
                if index == 1 and kill_points.armed("sync"):  # test hook: dies inside the session
                    kill_points.kill("sync", f"weight update {weight_version}: bucket 1 sent to "
                                             f"{members}, the session not ended")
        # every rank learns whether some sender lost a member (a sum is the collective here)
        if coord.sum([0.0 if lost is None else 1.0])[0] > 0:
            coord.last_members = None  # the group is re-formed, on every rank alike
            raise _as_member_lost(lost, weight_version)
        if coord.is_main:
            with timed(clock, "finish"):
                transport.finish(weight_version)
        transfer_s = time.perf_counter() - t1
    except BaseException:
        if coord.is_main:
            log.error("weight update to version %s failed; closing it on the servers", weight_version)
            engine.cancel_weight_update()
        raise
    totals = coord.sum([stats.num_tensors, stats.num_bytes, stats.num_buckets])
    stats.num_tensors, stats.num_bytes, stats.num_buckets = (int(v) for v in totals)
    if coord.is_main:
        stats.phases.update(engine.finish_weight_update(weight_version))
        stats.phases["weight_sync/transfer_s"] = transfer_s
        profile = {**clock, **(transport.profile if transport is not None else {})}
        stats.phases.update({f"weight_sync/{k}_s": v for k, v in profile.items()})
        engine.metrics.last_weight_sync = stats
    stats.seconds = time.perf_counter() - t0
    return stats


def _connect(transport: Optional[BucketTransport], members, coord: Coordinator,
             clock: Dict[str, float]) -> Optional[BaseException]:
    """(Re)form the senders' groups when the members changed, stage by stage (servers join one
    group at a time). A member lost meanwhile is returned, not raised: every rank must still
    reach the barriers and the gather."""
    lost = None
    if members == coord.last_members:
        return None
    for stage in range(coord.num_stages):
        if coord.is_sender and coord.stage == stage:
            with timed(clock, "connect"):
                try:
                    transport.connect(members)
                except Exception as exc:
                    if not _member_lost(exc):
                        raise
                    lost = exc
        coord.barrier()
    coord.last_members = members
    return lost


def _check_and_send(transport: BucketTransport, bucket: Bucket, members, weight_version: Optional[str],
                    index: int, clock: Dict[str, float]) -> Optional[BaseException]:
    """One bucket checked and sent; a member lost on the way is returned (the gather goes on,
    collective, and nothing more is sent), any other failure raised."""
    with timed(clock, "check"):
        transport.check_bucket(bucket, members)
    with timed(clock, "send"):
        try:
            _send(transport, bucket, weight_version, index)
        except BucketFailed as exc:
            if not _member_lost(exc):
                raise
            return exc
    return None


def _as_member_lost(lost: Optional[BaseException], weight_version: Optional[str]) -> "MemberLost":
    """The error every rank raises after an agreed loss (a rank that lost nothing itself says
    so: its stage's sender is another rank)."""
    if isinstance(lost, BucketFailed):
        return MemberLost(str(lost), weight_version, lost.index, lost.reason)
    what = (f"forming the weight-update group: {type(lost).__name__}: {lost}" if lost is not None
            else "a rollout server was lost by another rank that sends weights")
    return MemberLost(f"weight update {weight_version}: {what}", weight_version, 0, lost)


def _send(transport: BucketTransport, bucket: Bucket, weight_version: Optional[str], index: int) -> None:
    """``send_bucket``; a server's refusal or a timeout becomes :class:`BucketFailed` naming the
    bucket (a wrong key stays ``ServerAuthError``: a configuration error, not a lost bucket)."""
    from gspo_megatron.rollout.sglang.api import ServerRefused
    from gspo_megatron.rollout.sglang.client import ServerAuthError, ServerUnavailable

    try:
        transport.send_bucket(bucket, weight_version)
    except ServerAuthError:
        raise
    except (ServerRefused, ServerUnavailable, TimeoutError) as exc:
        raise BucketFailed(weight_version, index, bucket, exc) from exc


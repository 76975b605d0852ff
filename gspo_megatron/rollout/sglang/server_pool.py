"""The rollout servers behind one engine: membership, load, and what each one serves.

A server is a *member* while it is alive and serves the engine's current weights. One that
fails a request and then its health probe leaves the membership (the batch's samples go to the
others); it comes back only when it can be trusted again: either it answers ``/model_info``
with the engine's current ``weight_version`` (it was only briefly unreachable), or the next
weight sync re-admits it and sends it the new weights (a restarted process serves the initial
weights, so it must not generate before that sync).

Each server also remembers the request ids sent to it that have not been answered, including
attempts the client gave up on (SGLang keeps generating those until told otherwise): the sync
protocol aborts them by id.

Which member a request goes to (``rollout.sglang.routing``): ``least_loaded`` takes the member
with the fewest requests of ours in flight; ``prompt_affinity`` sends the samples of one prompt
to the server that took its first sample, so that SGLang prefills the shared prompt once and its
radix cache serves the rest (what sglang-router's ``cache_aware`` policy approximates by
matching text prefixes; ours knows the groups exactly). A group leaves its home only when the
home holds ``slack`` more requests than the least-loaded member (``slack``: the group's size),
or when the home failed this sample. docs/rollout.md compares the two with sglang-router
(``benchmarks/bench_routing.py``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Set, Tuple

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import SGLangServerClient, ServerUnavailable

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    """One server as the engine sees it."""

    client: SGLangServerClient
    outstanding: int = 0
    """Requests of this engine in flight on it (for least-loaded scheduling)."""
    alive: bool = True
    weight_version: Optional[str] = None
    """Version it was last synced to (None: never synced by this engine)."""
    sent_rids: Set[str] = field(default_factory=set)
    """Request ids sent and not answered (abandoned attempts included)."""

    @property
    def address(self) -> str:
        return self.client.address


ROUTINGS = ("least_loaded", "prompt_affinity")
"""Values of ``rollout.sglang.routing``."""
MAX_HOMES = 65536
"""Prompts whose home server is remembered (least recently used forgotten first): a step's
batch is far smaller, and a weight update flushes the servers' caches anyway."""


class NoLiveServer(RuntimeError):
    """Every server of the pool is out of rotation."""


class ServerPool:
    """Thread-safe membership and least-loaded choice among servers."""

    def __init__(self, clients: Sequence[SGLangServerClient], routing: str = "least_loaded") -> None:
        if not clients:
            raise ValueError("a rollout server pool needs at least one server address (host:port)")
        if routing not in ROUTINGS:
            raise ValueError(f"rollout.sglang.routing={routing!r}: expected one of {list(ROUTINGS)}")
        self.servers = [ServerState(c) for c in clients]
        self.routing = routing
        self._homes: "OrderedDict[str, ServerState]" = OrderedDict()
        """``prompt_affinity``: the server each prompt's samples go to."""
        self._lock = threading.Condition()

    @property
    def members(self) -> List[ServerState]:
        with self._lock:
            return [s for s in self.servers if s.alive]

    @property
    def dead(self) -> List[str]:
        with self._lock:
            return [s.address for s in self.servers if not s.alive]

    # --- scheduling -------------------------------------------------------------------------
    def acquire(self, tried: Set[str], current_version: Optional[str],
                prompt_key: Optional[str] = None, slack: int = 1) -> ServerState:
        """A member for the next attempt (see the module's docstring on routing), preferring
        ones this sample has not failed on. ``prompt_key``: the prompt the sample shares with
        its group; ``slack``: the group's size."""
        if not self.members:
            self.readmit_current(current_version)  # a transient failure may have marked all down
        with self._lock:
            live = [s for s in self.servers if s.alive]
            fresh = [s for s in live if s.address not in tried] or live
            if not fresh:
                raise NoLiveServer(f"no live rollout server among {[s.address for s in self.servers]}")
            server = self._choose(fresh, prompt_key, slack)
            server.outstanding += 1
            return server

    def _choose(self, fresh: List[ServerState], prompt_key: Optional[str],
                slack: int) -> ServerState:
        least = min(fresh, key=lambda s: s.outstanding)
        if self.routing != "prompt_affinity" or prompt_key is None:
            return least
        home = self._homes.get(prompt_key)
        if home is not None and home.alive:
            self._homes.move_to_end(prompt_key)
            if any(s is home for s in fresh) and home.outstanding - least.outstanding < slack:
                return home
            return least  # overflow, or this sample failed there: the group keeps its home
        self._homes[prompt_key] = least
        if len(self._homes) > MAX_HOMES:
            self._homes.popitem(last=False)
        return least

    def release(self, server: ServerState) -> None:
        with self._lock:
            server.outstanding -= 1
            self._lock.notify_all()

    def num_outstanding(self) -> int:
        """Requests of this engine in flight on any server."""
        with self._lock:
            return sum(s.outstanding for s in self.servers)

    def wait_no_outstanding(self, timeout_s: float) -> bool:
        """Block until no request of this engine is in flight; False after ``timeout_s``."""
        with self._lock:
            return self._lock.wait_for(lambda: not any(s.outstanding for s in self.servers),
                                       timeout=timeout_s)

    def sent(self, server: ServerState, rid: str) -> None:
        with self._lock:
            server.sent_rids.add(rid)

    def answered(self, server: ServerState, rid: str) -> None:
        with self._lock:
            server.sent_rids.discard(rid)

    def in_flight(self) -> List[str]:
        """``<address>/<request id>`` of every request sent and not yet answered."""
        with self._lock:
            return sorted(f"{s.address}/{rid}" for s in self.servers for rid in s.sent_rids)

    def take_sent(self, server: ServerState) -> List[str]:
        """The ids sent to ``server`` and not answered, forgotten here (the sync aborts them),
        while workers may be adding and answering others."""
        with self._lock:
            rids, server.sent_rids = sorted(server.sent_rids), set()
        return rids

    def mark_dead(self, server: ServerState, reason: str) -> None:
        with self._lock:
            was_alive, server.alive = server.alive, False
        if was_alive:
            log.warning("rollout server %s leaves the rotation: %s", server.address, reason)

    # --- re-admission -----------------------------------------------------------------------
    def _reachable_version(self, server: ServerState) -> Tuple[bool, Optional[str]]:
        try:
            info = server.client.model_info(timeout_s=5.0)
        except (ServerUnavailable, api.ServerRefused, ValueError):
            return False, None
        return True, info.get("weight_version")

    def readmit_current(self, current_version: Optional[str]) -> List[str]:
        """Re-admit dead servers that serve ``current_version`` (no sync needed); their names."""
        back = []
        for s in [s for s in self.servers if not s.alive]:
            ok, version = self._reachable_version(s)
            if ok and (current_version is None or version == current_version):
                with self._lock:
                    s.alive = True
                log.info("rollout server %s is back (weight_version %s)", s.address, version)
                back.append(s.address)
        return back

    def readmit_for_sync(self) -> List[str]:
        """Re-admit every reachable dead server; the sync about to run sends it the weights."""
        back = []
        for s in [s for s in self.servers if not s.alive]:
            if self._reachable_version(s)[0]:
                with self._lock:
                    s.alive = True
                log.info("rollout server %s is reachable again; it rejoins with this sync", s.address)
                back.append(s.address)
        return back

    # --- fleet-wide calls -------------------------------------------------------------------
    def on_members(self, call: Callable[[ServerState], None], what: str) -> List[str]:
        """Run ``call`` on every member in parallel. A member that is unreachable leaves the
        rotation (its address is returned); a refusal (:class:`api.ServerRefused`) propagates."""
        members = self.members
        if not members:
            raise NoLiveServer(f"{what}: no live rollout server among "
                               f"{[s.address for s in self.servers]}")
        lost: List[str] = []
        with ThreadPoolExecutor(max_workers=len(members), thread_name_prefix="rollout-ctl") as pool:
            futures = [(s, pool.submit(call, s)) for s in members]
            for s, fut in futures:
                try:
                    fut.result()
                except ServerUnavailable as exc:
                    self.mark_dead(s, f"{what}: {exc}")
                    lost.append(s.address)
        return lost

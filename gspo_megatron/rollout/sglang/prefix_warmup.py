"""Prefill a group's prompt once on a server before its samples go there.

The ``n`` samples of a prompt reach a server together. SGLang's default schedule (``fcfs``,
``srt/arg_groups/fields/schedule.py``) prefills requests that arrive together each in full: its
radix cache only serves a prompt to requests that come after one holding it has been
prefilled. SGLang's own parallel sampling (``n > 1`` in one request) therefore first sends the
prompt with ``max_new_tokens`` 0 and waits for it (``srt/managers/tokenizer_manager.py``,
"Cache the common prefix for parallel sampling"). We send each sample as its own request (its own
seed, id, abort and partial rollout), so we do the same: with ``rollout.sglang.routing=
prompt_affinity`` the first sample of a prompt to reach a server prefills the prompt there
(:func:`api.prefill_payload`) and the others wait for it, at most ``timeout_s``.

A warm-up that fails is not a failure of the sample: it is logged and the samples are sent
anyway (their own requests meet whatever the server's problem is and are retried as usual).
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, Iterable, Tuple

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import ServerUnavailable
from gspo_megatron.rollout.sglang.server_pool import ServerPool, ServerState
from gspo_megatron.rollout.types import GenerationRequest

log = logging.getLogger(__name__)


class PrefixWarmup:
    """Which (prompt, server) pairs are prefilled or being prefilled, and the waits for them."""

    def __init__(self, pool: ServerPool, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._events: Dict[Tuple[str, str], threading.Event] = {}
        self.num_prefills = 0
        """Warm-up requests sent (one per prompt and server its samples went to)."""

    def before_first_attempt(self, server: ServerState, req: GenerationRequest) -> None:
        """Return once ``req``'s prompt is in ``server``'s cache (or its warm-up ended)."""
        key = (req.prompt_id, server.address)
        with self._lock:
            event = self._events.get(key)
            owner = event is None
            if owner:
                event = self._events[key] = threading.Event()
                self.num_prefills += 1
        if not owner:
            if not event.wait(self.timeout_s):
                log.warning("the warm-up of prompt %s on %s took over %.0fs; its samples go on",
                            req.prompt_id, server.address, self.timeout_s)
            return
        try:
            self._prefill(server, req)
        finally:
            event.set()

    def _prefill(self, server: ServerState, req: GenerationRequest) -> None:
        rid = f"{req.prompt_id}/prefill"
        self.pool.sent(server, rid)  # a sync that pauses the fleet aborts it like any request
        try:
            server.client.prefill(api.prefill_payload(rid, list(req.prompt_token_ids)),
                                  timeout_s=self.timeout_s)
        except ServerUnavailable as exc:
            log.warning("warm-up of prompt %s on %s failed: %s", req.prompt_id, server.address, exc)
            if exc.timed_out:
                return  # stays in sent_rids: the next sync aborts it
        except api.ServerRefused as exc:
            log.warning("warm-up of prompt %s refused by %s: %s", req.prompt_id, server.address, exc)
        self.pool.answered(server, rid)

    def forget(self, prompt_ids: Iterable[str]) -> None:
        """Drop the records of these prompts (their batch ended)."""
        gone = set(prompt_ids)
        with self._lock:
            for key in [k for k in self._events if k[0] in gone]:
                del self._events[key]

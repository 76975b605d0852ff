"""The continuous generator of ``rollout.max_staleness >= 2``: prompt groups keep the rollout
servers busy while the learner trains, across weight updates.

Runs on the main rank. One admission thread draws prompts in the sampler's order and hands each
group (one prompt, ``n`` samples) to a worker; workers call the engine, score the finished group
and put it in the buffer, where :meth:`AsyncGenerator.take` finds it. A weight sync in the
loop's thread pauses the servers meanwhile; the SGLang engine keeps a request's partial tokens
and goes on under the new weights (``rollout/sglang/engine.py``, partial rollouts), and every
token's weight version travels in ``Sample.token_versions``.

Staleness. A group may be admitted only while the groups admitted and not yet taken number fewer
than ``(k + 1) * B`` (B: ``batch.num_prompts_per_step``): it is then among the next ``k + 1``
batches the learner takes if it finishes in turn, so its oldest token trains at most ``k`` RL
steps after its version (AReaL's ``max_head_offpolicyness`` admission, counted in groups). A group
that finishes out of turn and is older than ``k`` when taken is dropped and counted
(``async/dropped_stale_groups``); so is a group whose rewards are all equal under
``algo.dynamic_sampling`` (``async/dropped_zero_variance_groups``).

Checkpoints (:meth:`snapshot`): the buffer's finished groups are saved whole; a group still in
flight is saved as its prompt and admission index, and regenerated first after a resume, with the
same seed (its partial tokens are discarded and counted: their weights may be gone). The snapshot
holds the sampler's state at that instant, so the resumed run draws exactly the prompts the
snapshot had not: none trains twice, none loses its place. At the run's end the groups in flight
are finished and dropped (``close``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from gspo_megatron.algorithms.advantages import compute_group_advantages
from gspo_megatron.data.records import PromptRecord
from gspo_megatron.rollout.types import GenerationRequest, Sample, SamplingParams

log = logging.getLogger(__name__)


class GeneratorFailed(RuntimeError):
    """A group could not be generated or scored; the run stops with its cause."""


@dataclass
class FinishedGroup:
    """One prompt's ``n`` scored samples, in the buffer until a step takes it."""

    index: int
    """Admission index: orders groups and seeds their generation."""
    record: PromptRecord
    samples: List[Sample]
    rewards: List[float]
    advantages: List[float]
    oldest_version: int
    """The oldest weight version of any of its tokens."""
    finished_at: float = field(default_factory=time.monotonic)


def sample_versions(sample: Sample) -> List[int]:
    """The weight version of each response token (one version for an engine without spans)."""
    if sample.token_versions is not None:
        if len(sample.token_versions) != len(sample.response_token_ids):
            raise GeneratorFailed(
                f"sample (prompt_id={sample.prompt_id!r}, index {sample.sample_index}) has "
                f"{len(sample.token_versions)} token versions for "
                f"{len(sample.response_token_ids)} tokens")
        return [int(v) for v in sample.token_versions]
    if sample.weight_version is None:
        raise GeneratorFailed(f"sample (prompt_id={sample.prompt_id!r}) carries no weight "
                              "version; rollout.max_staleness >= 2 needs the version of every "
                              "token (SGLang servers report it)")
    return [int(sample.weight_version)] * len(sample.response_token_ids)


def group_seed(run_seed: int, index: int) -> int:
    """The sampling seed of the group admitted ``index``-th (resumed groups keep theirs)."""
    return (run_seed * 1_000_003 + 7_919 * index + 17) % (2**31)


class AsyncGenerator:
    """Admission thread, workers and buffer; see the module docstring."""

    def __init__(self, engine, sampler, score: Callable[[List[Sample], PromptRecord], List[float]],
                 params: SamplingParams, *, n: int, groups_per_step: int, max_staleness: int,
                 groups_in_flight: int, run_seed: int, advantage_mode: str, advantage_eps: float,
                 drop_zero_variance: bool, wait_timeout_s: float) -> None:
        self.engine = engine
        self.sampler = sampler
        self.score = score
        self.params = params
        self.n = n
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.groups_in_flight = groups_in_flight
        self.run_seed = run_seed
        self.advantage_mode = advantage_mode
        self.advantage_eps = advantage_eps
        self.drop_zero_variance = drop_zero_variance
        self.wait_timeout_s = wait_timeout_s
        """The longest :meth:`take` waits for a finished group before it names the stall."""
        self.lock = threading.Condition()
        """Guards everything below and the sampler (the loop retires prompts through it)."""
        self._admitted = 0
        self._requeued: Deque[Tuple[int, PromptRecord]] = deque()
        self._in_flight: Dict[int, PromptRecord] = {}
        self._buffer: List[FinishedGroup] = []
        self._error: Optional[BaseException] = None
        self._stop = False
        self.counters: Dict[str, float] = {"dropped_stale_groups": 0.0,
                                           "dropped_zero_variance_groups": 0.0,
                                           "discarded_in_flight_groups": 0.0}
        self._workers: Optional[ThreadPoolExecutor] = None
        self._thread: Optional[threading.Thread] = None

    # ---- the admission thread --------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._workers = ThreadPoolExecutor(max_workers=self.groups_in_flight,
                                           thread_name_prefix="async-group")
        self._thread = threading.Thread(target=self._admit_loop, name="async-admission",
                                        daemon=True)
        self._thread.start()

    def _room(self) -> bool:
        waiting = len(self._in_flight) + len(self._buffer)
        return (len(self._in_flight) < self.groups_in_flight
                and waiting < (self.max_staleness + 1) * self.groups_per_step)

    def _admit_loop(self) -> None:
        while True:
            with self.lock:
                while not self._stop and self._error is None and not self._room():
                    self.lock.wait(timeout=1.0)
                if self._stop or self._error is not None:
                    return
                try:
                    if self._requeued:
                        index, record = self._requeued.popleft()
                    else:
                        record = self.sampler.next_batch(1)[0]
                        index = self._admitted
                        self._admitted += 1
                except Exception as exc:  # e.g. every prompt retired
                    self._fail(exc)
                    return
                self._in_flight[index] = record
            self._workers.submit(self._run_group, index, record)

    def _fail(self, exc: BaseException) -> None:
        """Under the lock: the first error ends admission and wakes :meth:`take`."""
        if self._error is None:
            self._error = exc
        self.lock.notify_all()

    def _run_group(self, index: int, record: PromptRecord) -> None:
        try:
            group = self._generate(index, record)
        except BaseException as exc:
            with self.lock:
                self._in_flight.pop(index, None)
                self._fail(GeneratorFailed(f"prompt group {index} ({record.prompt_id!r}): "
                                           f"{type(exc).__name__}: {exc}"))
            return
        with self.lock:
            if self._in_flight.pop(index, None) is None:  # discarded by a restore meanwhile
                return
            if group is None:
                self.counters["dropped_zero_variance_groups"] += 1
            elif not self._stop:
                self._buffer.append(group)
            self.lock.notify_all()

    def _generate(self, index: int, record: PromptRecord) -> Optional[FinishedGroup]:
        # A request id unique to this group: the same prompt may be in flight twice.
        rid = f"{record.prompt_id}@{index}"
        params = dataclasses.replace(self.params, seed=group_seed(self.run_seed, index))
        out = self.engine.generate([GenerationRequest(rid, list(record.prompt_token_ids),
                                                      n=self.n)], params)
        samples = [dataclasses.replace(s, prompt_id=record.prompt_id)
                   for s in sorted(out, key=lambda s: s.sample_index)]
        rewards = [float(r) for r in self.score(samples, record)]
        adv, zero_var = compute_group_advantages(torch.tensor([rewards], dtype=torch.float64),
                                                 mode=self.advantage_mode, eps=self.advantage_eps)
        if self.drop_zero_variance and bool(zero_var[0]):
            return None
        oldest = min(min(sample_versions(s), default=int(s.weight_version or 0)) for s in samples)
        return FinishedGroup(index, record, samples, rewards, adv[0].tolist(), oldest)

    # ---- the loop's side -------------------------------------------------------------------
    def take(self, lag_of: Callable[[int], int]) -> Tuple[List[FinishedGroup], float]:
        """The next ``groups_per_step`` finished groups no older than ``k`` (``lag_of(version)``:
        RL steps since that weight version), in the order they finished; older ones are dropped
        and counted. Returns them and the seconds waited."""
        t0 = time.monotonic()
        taken: List[FinishedGroup] = []
        with self.lock:
            while len(taken) < self.groups_per_step:
                while self._buffer:
                    group = self._buffer.pop(0)
                    if lag_of(group.oldest_version) > self.max_staleness:
                        self.counters["dropped_stale_groups"] += 1
                        continue
                    taken.append(group)
                    if len(taken) == self.groups_per_step:
                        break
                if len(taken) == self.groups_per_step:
                    break
                if self._error is not None:
                    raise self._error
                if self._thread is None:
                    raise RuntimeError("take() before the generator was started")
                if not self.lock.wait(timeout=self.wait_timeout_s):
                    raise GeneratorFailed(
                        f"no prompt group finished in {self.wait_timeout_s:.0f}s "
                        f"({len(self._in_flight)} in flight, {len(taken)} of "
                        f"{self.groups_per_step} taken); the rollout servers are stalled")
            self.lock.notify_all()  # room for admission
        return taken, time.monotonic() - t0

    def gauges(self) -> Dict[str, float]:
        with self.lock:
            return {"in_flight_groups": float(len(self._in_flight)),
                    "buffer_groups": float(len(self._buffer)), **self.counters}

    # ---- checkpoints -----------------------------------------------------------------------
    def snapshot(self) -> Dict[str, Any]:
        """Plain values: the buffer, the prompts in flight, the counters, the sampler's state."""
        with self.lock:
            return {"admitted": self._admitted,
                    "sampler": self.sampler.state_dict(),
                    "buffer": [_group_state(g) for g in self._buffer],
                    "in_flight": [[i, dataclasses.asdict(r)] for i, r in
                                  sorted(self._in_flight.items())]
                    + [[i, dataclasses.asdict(r)] for i, r in self._requeued],
                    "counters": dict(self.counters)}

    def restore(self, state: Dict[str, Any]) -> None:
        """Before :meth:`start`: put back what :meth:`snapshot` saved."""
        if self.started:
            raise RuntimeError("restore() after the generator started")
        self.sampler.load_state_dict(state["sampler"])
        self._admitted = int(state["admitted"])
        self._buffer = [_group_from_state(g) for g in state["buffer"]]
        self._requeued = deque((int(i), _record(r)) for i, r in state["in_flight"])
        self.counters = {k: float(v) for k, v in state["counters"].items()}
        self.counters["discarded_in_flight_groups"] += len(self._requeued)
        if self._requeued:
            log.info("resume: %d prompt groups were in flight at the checkpoint; their partial "
                     "samples are discarded and the prompts generated again first",
                     len(self._requeued))

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop admitting; wait (up to ``timeout_s``) for the groups in flight, then drop them."""
        with self.lock:
            self._stop = True
            self.lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        if self._workers is not None:
            deadline = time.monotonic() + timeout_s
            with self.lock:
                while self._in_flight and time.monotonic() < deadline:
                    self.lock.wait(timeout=0.5)
                left = len(self._in_flight)
            if left:
                log.warning("%d prompt groups still generating after %.0fs at shutdown; "
                            "leaving them to the engine's shutdown", left, timeout_s)
            self._workers.shutdown(wait=not left, cancel_futures=True)


def _record(state: Dict[str, Any]) -> PromptRecord:
    return PromptRecord(**{**state, "prompt_token_ids": tuple(state["prompt_token_ids"])})


def _group_state(g: FinishedGroup) -> Dict[str, Any]:
    return {"index": g.index, "record": dataclasses.asdict(g.record),
            "samples": [dataclasses.asdict(s) for s in g.samples], "rewards": g.rewards,
            "advantages": g.advantages, "oldest_version": g.oldest_version}


def _group_from_state(state: Dict[str, Any]) -> FinishedGroup:
    return FinishedGroup(int(state["index"]), _record(state["record"]),
                         [Sample(**s) for s in state["samples"]], list(state["rewards"]),
                         list(state["advantages"]), int(state["oldest_version"]))

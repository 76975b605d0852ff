"""The stand-in's GPU memory: one simulated GPU's ledger, shared by the processes that use it.

Colocated mode works only if the learner and the SGLang servers take and give back memory in an
order that fits the GPU at every moment (``planner/colocated.py``). On CPU nothing runs out, so
the reference server can keep a ledger instead: a JSON file holding the GPU's budget and, per
``owner/tag``, the bytes held, plus every allocation and release in order. An allocation that
would not fit is refused (:class:`OutOfMemory`, naming what is held), as CUDA would refuse it.

The reference server takes ``--memory-ledger PATH`` (or ``GSPO_REFERENCE_MEMORY_LEDGER``): at
start it holds SGLang's static pool, ``--mem-fraction-static`` of the memory free then, as
``weights`` (the model's bytes) and ``kv_cache`` (the rest); ``/release_memory_occupation``
frees tags and ``/resume_memory_occupation`` allocates them again, refused when they no longer
fit. Tests add the learner's side with the same calls (``tests/test_trainer_colocated_memory.py``).
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from typing import Dict, Iterator, List

LEDGER_ENV = "GSPO_REFERENCE_MEMORY_LEDGER"


class OutOfMemory(RuntimeError):
    """An allocation that does not fit the ledger's budget."""


class MemoryLedger:
    """``owner/tag -> bytes`` against ``budget_bytes``, in a file any process can open."""

    def __init__(self, path: str) -> None:
        self.path = path
        if not os.path.exists(path):
            raise FileNotFoundError(f"memory ledger {path} does not exist (MemoryLedger.create)")

    @classmethod
    def create(cls, path: str, budget_bytes: int) -> "MemoryLedger":
        with open(path, "w") as f:
            json.dump({"budget_bytes": int(budget_bytes), "held": {}, "events": []}, f)
        return cls(path)

    @contextmanager
    def _locked(self) -> Iterator[dict]:
        with open(self.path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            state = json.load(f)
            try:
                yield state
            finally:  # a refusal is recorded too
                f.seek(0)
                f.truncate()
                json.dump(state, f)

    def allocate(self, owner: str, tag: str, nbytes: int) -> None:
        """Hold ``nbytes`` more under ``owner/tag``; :class:`OutOfMemory` when they do not fit."""
        key = f"{owner}/{tag}"
        with self._locked() as state:
            used = sum(state["held"].values())
            if used + nbytes > state["budget_bytes"]:
                state["events"].append(["refused", key, int(nbytes), used])
                held = ", ".join(f"{k} {v}" for k, v in sorted(state["held"].items())) or "nothing"
                raise OutOfMemory(f"{key} needs {nbytes} bytes, {state['budget_bytes'] - used} of "
                                  f"{state['budget_bytes']} free on the ledger {self.path} "
                                  f"(held: {held})")
            state["held"][key] = state["held"].get(key, 0) + int(nbytes)
            state["events"].append(["allocate", key, int(nbytes), used + int(nbytes)])

    def free(self, owner: str, tag: str) -> int:
        """Give back everything ``owner/tag`` holds; returns the bytes freed."""
        key = f"{owner}/{tag}"
        with self._locked() as state:
            nbytes = state["held"].pop(key, 0)
            state["events"].append(["free", key, nbytes, sum(state["held"].values())])
            return nbytes

    def free_bytes(self) -> int:
        with self._locked() as state:
            return state["budget_bytes"] - sum(state["held"].values())

    def state(self) -> Dict:
        with open(self.path) as f:
            return json.load(f)

    def events(self) -> List[list]:
        """``[op, owner/tag, bytes, used after]`` in order (``op``: allocate, free, refused)."""
        return self.state()["events"]


class ServerMemory:
    """One reference server's static pool on a ledger (SGLang's tags: weights, kv_cache,
    cuda_graph; the stand-in has no CUDA graphs, so that tag holds nothing)."""

    def __init__(self, ledger: MemoryLedger, owner: str, weights_bytes: int,
                 mem_fraction_static: float) -> None:
        self.ledger, self.owner = ledger, owner
        pool = int(mem_fraction_static * ledger.free_bytes())
        if pool < weights_bytes:
            raise OutOfMemory(f"{owner}: mem_fraction_static={mem_fraction_static} of the free "
                              f"memory ({pool} bytes) does not hold the weights ({weights_bytes})")
        self.sizes = {"weights": int(weights_bytes), "kv_cache": pool - int(weights_bytes),
                      "cuda_graph": 0}
        for tag in ("weights", "kv_cache", "cuda_graph"):
            ledger.allocate(owner, tag, self.sizes[tag])

    def release(self, tags) -> None:
        for tag in tags:
            self.ledger.free(self.owner, tag)

    def resume(self, tags) -> None:
        """All of ``tags`` or none (a refused resume leaves nothing half-held)."""
        done = []
        try:
            for tag in tags:
                self.ledger.allocate(self.owner, tag, self.sizes[tag])
                done.append(tag)
        except OutOfMemory:
            self.release(done)
            raise

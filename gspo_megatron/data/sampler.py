"""Draw prompt batches across epochs, resumably, with query-set refresh.

Each epoch visits every record once in an order fixed by ``(seed, epoch)`` (or in file order
without shuffling); a batch that runs past the end of an epoch continues into the next one. The
position — epoch, index into that epoch's order, retired prompt ids — is the sampler's whole
state, so ``state_dict()`` saved in a checkpoint and ``load_state_dict()`` on resume make a
resumed run draw exactly the prompts the uninterrupted run would have drawn.

Query-set refresh (the GSPO paper's "regularly updating the query set"): ``retire(ids)`` removes
prompts from all later draws; ``retire_saturated(groups)`` retires those whose samples were all
solved or all failed, since their group-normalised advantages are zero and they only cost
generation time. Retired prompts are skipped in place, so the visiting order of the others does
not change and a resumed run stays identical.

    sampler = PromptSampler(dataset.records, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    batch = sampler.next_batch(cfg.batch.num_prompts_per_step)
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import asdict, dataclass
from typing import Dict, Iterable, List, Mapping, Sequence

from gspo_megatron.data.records import PromptRecord

logger = logging.getLogger(__name__)


@dataclass
class SamplerStats:
    """Counters reported in the run's metrics."""

    epoch: int
    """0-based index of the epoch the next prompt comes from (advanced lazily)."""
    num_drawn: int
    num_active: int
    num_retired: int
    num_retired_solved: int
    num_retired_unsolved: int


def _fingerprint(records: Sequence[PromptRecord]) -> str:
    digest = hashlib.sha256()
    for record in records:
        digest.update(record.prompt_id.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


class PromptSampler:
    """Endless, seeded, checkpointable stream of prompt batches."""

    def __init__(self, records: Sequence[PromptRecord], seed: int, shuffle: bool = True):
        if not records:
            raise ValueError("PromptSampler needs at least one prompt")
        self._records = list(records)
        self._index_of: Dict[str, int] = {r.prompt_id: i for i, r in enumerate(self._records)}
        if len(self._index_of) != len(self._records):
            raise ValueError("prompt ids must be unique")
        self._seed = seed
        self._shuffle = shuffle
        self._fingerprint = _fingerprint(self._records)
        self._epoch = 0
        self._position = 0
        self._num_drawn = 0
        self._retired: Dict[str, str] = {}
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> List[int]:
        order = list(range(len(self._records)))
        if self._shuffle:
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order

    @property
    def num_active(self) -> int:
        return len(self._records) - len(self._retired)

    def next_batch(self, num_prompts: int) -> List[PromptRecord]:
        """The next ``num_prompts`` active prompts (crossing into a new epoch when needed).

        With fewer active prompts than ``num_prompts`` a batch holds some prompts twice.
        """
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        if self.num_active == 0:
            raise RuntimeError(f"all {len(self._records)} prompts have been retired; "
                               "disable data.retire_solved_prompts or use a larger dataset")
        batch: List[PromptRecord] = []
        while len(batch) < num_prompts:
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
                logger.info("prompt sampler: starting epoch %d", self._epoch)
            record = self._records[self._order[self._position]]
            self._position += 1
            if record.prompt_id not in self._retired:
                batch.append(record)
        self._num_drawn += len(batch)
        return batch

    def retire(self, prompt_ids: Iterable[str], reason: str = "requested") -> int:
        """Remove prompts from all later draws; returns how many were newly retired."""
        newly = 0
        for prompt_id in prompt_ids:
            if prompt_id not in self._index_of:
                raise KeyError(f"cannot retire unknown prompt id '{prompt_id}'")
            if prompt_id not in self._retired:
                self._retired[prompt_id] = reason
                newly += 1
        return newly

    def retire_saturated(self, rewards_by_prompt: Mapping[str, Sequence[float]],
                         solved_threshold: float = 1.0) -> List[str]:
        """Retire prompts whose samples all reach ``solved_threshold`` or all score <= 0."""
        solved = [p for p, r in rewards_by_prompt.items() if r and min(r) >= solved_threshold]
        unsolved = [p for p, r in rewards_by_prompt.items() if r and max(r) <= 0.0]
        self.retire(solved, reason="solved")
        self.retire(unsolved, reason="unsolved")
        return solved + unsolved

    def stats(self) -> SamplerStats:
        reasons = list(self._retired.values())
        return SamplerStats(epoch=self._epoch, num_drawn=self._num_drawn,
                            num_active=self.num_active, num_retired=len(self._retired),
                            num_retired_solved=reasons.count("solved"),
                            num_retired_unsolved=reasons.count("unsolved"))

    def state_dict(self) -> dict:
        """Plain-Python state (JSON/pickle safe) for the trainer checkpoint."""
        return {"seed": self._seed, "shuffle": self._shuffle, "fingerprint": self._fingerprint,
                "num_records": len(self._records), "epoch": self._epoch,
                "position": self._position, "num_drawn": self._num_drawn,
                "retired": dict(self._retired)}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a position saved by :meth:`state_dict` on the same dataset and settings."""
        expected = {"seed": self._seed, "shuffle": self._shuffle,
                    "fingerprint": self._fingerprint, "num_records": len(self._records)}
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(f"sampler state does not match this dataset/settings: "
                                 f"{key}={state.get(key)!r} in the checkpoint, {value!r} now")
        unknown = [p for p in state["retired"] if p not in self._index_of]
        if unknown:
            raise ValueError(f"sampler state retires unknown prompt ids, e.g. {unknown[:3]}")
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._num_drawn = int(state["num_drawn"])
        self._retired = dict(state["retired"])
        self._order = self._epoch_order(self._epoch)

    def stats_dict(self) -> dict:
        return asdict(self.stats())

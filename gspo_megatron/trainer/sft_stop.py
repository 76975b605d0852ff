"""When the cold start stops: after ``trainer.num_sft_steps``, or earlier at a loss target.

On the tiny addition task supervised training sits on a loss plateau (the answer format is
learnt, the carries are not) and then drops within a few dozen steps; *when* it drops depends on
the data order (the seed) and on floating-point details of the machine: measured after 320 steps,
held-out accuracy 4.5% for one seed and 51.5% for another (docs/tiny_cpu_run.md). A fixed step
count therefore hands RL very different policies on different machines. Stopping once the loss,
averaged over the last :data:`WINDOW` steps, is below ``trainer.sft_stop_loss`` starts RL from
comparable policies everywhere. Every rank sees the same (reduced) loss, so all stop together.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

WINDOW = 20
"""SFT steps averaged before comparing with the target (one batch's loss is noisy)."""


class SftStopRule:
    """``update(loss)`` after each SFT step; True once the windowed mean is below the target."""

    def __init__(self, target_loss: Optional[float], window: int = WINDOW) -> None:
        self.target = target_loss
        self.losses: deque = deque(maxlen=window)

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")

    def update(self, loss: float) -> bool:
        self.losses.append(loss)
        return (self.target is not None and len(self.losses) == self.losses.maxlen
                and self.mean_loss < self.target)

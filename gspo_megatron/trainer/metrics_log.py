"""Where run metrics go: a JSONL file in the run directory, wandb (offline by default), a plot.

Only the main rank writes. wandb is optional at run time: ``logging.wandb.enabled=false`` or
mode ``disabled`` skips it, and ``online`` is used only when an API key is present (otherwise the
run stays offline and says so), so a laptop or CI run never blocks on the network.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Dict, List, Optional

log = logging.getLogger(__name__)


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    """Append-only metrics sink; ``history`` keeps what was logged for the plot."""

    def __init__(self, run_dir: str | Path, wandb_cfg=None, config_dict: Optional[dict] = None,
                 enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.history: List[Dict[str, float]] = []
        self._wandb_run = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # a resumed run continues the same file
            with open(self.path) as f:
                self.history = [json.loads(line) for line in f if line.strip()]
        if wandb_cfg is not None and wandb_cfg.enabled and wandb_cfg.mode != "disabled":
            self._wandb_run = self._start_wandb(Path(run_dir), wandb_cfg, config_dict)

    @staticmethod
    def _start_wandb(run_dir: Path, wandb_cfg, config_dict):
        import wandb

        mode = wandb_cfg.mode
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):
            log.warning("logging.wandb.mode=online but WANDB_API_KEY is not set: logging offline")
            mode = "offline"
        os.environ.setdefault("WANDB_CACHE_DIR", str(run_dir / "wandb_cache"))
        os.environ.setdefault("WANDB_DIR", str(run_dir))
        return wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity,
                          name=wandb_cfg.name or run_dir.name, mode=mode, dir=str(run_dir),
                          config=config_dict, resume="allow")

    def truncate_after(self, step: int) -> None:
        """On resume, forget rows newer than the checkpoint (they will be produced again)."""
        if not self.enabled:
            return
        self.history = [row for row in self.history if row.get("step", -1) <= step]
        with open(self.path, "w") as f:
            for row in self.history:
                f.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.history.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
        if self._wandb_run is not None:
            self._wandb_run.log(metrics, step=step)

    def close(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

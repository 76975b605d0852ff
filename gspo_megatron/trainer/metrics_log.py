"""Where run metrics go: a JSONL file in the run directory, wandb (offline by default), a plot.

Only the main rank writes. wandb is optional at run time: ``logging.wandb.enabled=false`` or
mode ``disabled`` skips it, and ``online`` is used only when an API key is present (otherwise the
run stays offline and says so), so a laptop or CI run never blocks on the network.

Both sinks agree with the checkpoint the run starts from. :meth:`MetricsLogger.start` keeps the
rows of ``metrics.jsonl`` up to the resumed step (none on a fresh start: those rows belong to an
attempt whose state is gone), drops a torn last line (a crash mid-write) with a warning, and
rewrites the file atomically. wandb cannot delete logged history, so the wandb run id is kept in
``wandb_run.json``: a resume continues that run when it had logged nothing past the checkpoint,
and otherwise starts a new run (same name) into which the kept rows are replayed, so that the
wandb run always holds exactly the rows of ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from pathlib import Path
from typing import Dict, List, Optional

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
WANDB_STATE_FILE = "wandb_run.json"


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _line(row: Dict[str, float]) -> str:
    return json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n"


def read_rows(path: Path) -> List[Dict[str, float]]:
    """Rows of a metrics file; a torn or damaged line is skipped with a warning naming it."""
    rows = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
                if not isinstance(row, dict) or "step" not in row:
                    raise ValueError("not a metrics row")
            except ValueError as exc:
                torn = not raw.endswith(b"\n")
                log.warning("%s:%d: dropping %s (%s)", path, line_no,
                            "a torn last line" if torn else "a damaged line", exc)
                continue
            rows.append(row)
    return rows


class MetricsLogger:
    """Metrics sink; ``history`` keeps what was logged for the plot. Call :meth:`start` first."""

    def __init__(self, run_dir: str | Path, wandb_cfg=None, config_dict: Optional[dict] = None,
                 enabled: bool = True) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.history: List[Dict[str, float]] = []
        self._wandb_cfg = wandb_cfg
        self._config_dict = config_dict
        self._wandb_run = None

    def start(self, resumed_step: Optional[int]) -> None:
        """Trim to ``resumed_step`` (everything on a fresh start, None), then open wandb."""
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        old = read_rows(self.path) if self.path.exists() else []
        keep = [] if resumed_step is None else [r for r in old if r["step"] <= resumed_step]
        if len(keep) != len(old):
            log.info("%s: dropped %d rows past %s", self.path, len(old) - len(keep),
                     f"the resumed step {resumed_step}" if resumed_step is not None
                     else "a fresh start")
        self.history = keep
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(_line(r) for r in keep))
        os.replace(tmp, self.path)
        cfg = self._wandb_cfg
        if cfg is not None and cfg.enabled and cfg.mode != "disabled":
            last_logged = max((r["step"] for r in old), default=None)
            continue_run = (resumed_step is not None and last_logged is not None
                            and last_logged <= resumed_step)
            self._wandb_run = self._start_wandb(cfg, continue_run)

    def _start_wandb(self, wandb_cfg, continue_run: bool):
        import wandb

        mode = wandb_cfg.mode
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):
            log.warning("logging.wandb.mode=online but WANDB_API_KEY is not set: logging offline")
            mode = "offline"
        os.environ.setdefault("WANDB_CACHE_DIR", str(self.run_dir / "wandb_cache"))
        os.environ.setdefault("WANDB_DIR", str(self.run_dir))
        state_path = self.run_dir / WANDB_STATE_FILE
        previous = json.loads(state_path.read_text()).get("id") if state_path.is_file() else None
        run_id = previous if (continue_run and previous) else uuid.uuid4().hex[:12]
        run = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity,
                         name=wandb_cfg.name or self.run_dir.name, group=wandb_cfg.group, mode=mode,
                         dir=str(self.run_dir), config=self._config_dict, id=run_id,
                         resume="allow")
        state_path.write_text(json.dumps({"id": run_id}))
        if run_id != previous:
            if previous:
                log.info("wandb run %s logged past the checkpoint; continuing in new run %s "
                         "with the %d rows kept", previous, run_id, len(self.history))
            for row in self.history:
                run.log({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))
        return run

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.history.append(row)
        with open(self.path, "a") as f:
            f.write(_line(row))
        if self._wandb_run is not None:
            self._wandb_run.log(metrics, step=step)

    def close(self) -> None:
        """Finish the wandb run and end wandb's service with it: ``finish`` leaves the SDK's
        asyncio thread and its service process running for the next ``init`` until
        ``wandb.teardown()`` (atexit otherwise), and a process that trains twice (a notebook,
        the tests) would keep them, running beside everything after."""
        if self._wandb_run is not None:
            import wandb

            self._wandb_run.finish()
            self._wandb_run = None
            wandb.teardown()

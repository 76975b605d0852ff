"""Results of the GPU verification kit: one :class:`CheckResult` per check, JSON and text.

Every check ends as ``pass``, ``fail`` (it ran and a number was out of bounds), ``error`` (it
raised; the traceback's tail is kept) or ``not_run`` (a prerequisite is missing, with the reason,
e.g. Transformer Engine absent). :meth:`Report.write` rewrites both files after every check, so
a run killed by its time limit still leaves what it had measured.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

STATUSES = ("pass", "fail", "error", "not_run")
Outcome = Tuple[bool, str, Dict[str, Any]]
"""What a check function returns: passed, a one-line message, the numbers it measured."""
JSON_NAME = "gpu_check.json"
TEXT_NAME = "gpu_check.txt"


class NotRun(Exception):
    """Raised by a check whose prerequisite is missing; the message says which and why."""


@dataclass
class CheckResult:
    """One check: its status, what it measured and why it passed or not."""

    name: str
    status: str
    message: str = ""
    numbers: Dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check {self.name}: status {self.status!r} not in {STATUSES}")


@dataclass
class Report:
    """All results of one kit run plus the environment it ran in."""

    mode: str
    """``gpu`` or ``cpu-dry-run``."""
    environment: Dict[str, Any] = field(default_factory=dict)
    checks: List[CheckResult] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    out_dir: Optional[Path] = None

    def add(self, result: CheckResult) -> None:
        self.checks.append(result)
        self.write()

    def status(self) -> str:
        """``pass`` when no check failed or errored (``not_run`` checks say why in the text)."""
        return "fail" if any(c.status in ("fail", "error") for c in self.checks) else "pass"

    def as_dict(self) -> Dict[str, Any]:
        return {"mode": self.mode, "status": self.status(),
                "started_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started_at)),
                "wall_s": round(time.time() - self.started_at, 1),
                "environment": self.environment, "checks": [asdict(c) for c in self.checks]}

    def summary(self) -> str:
        """A few lines per check: status, time, message and the headline numbers."""
        d = self.as_dict()
        lines = [f"gpu_check ({d['mode']}): {d['status'].upper()} in {d['wall_s']} s, "
                 f"{d['started_at']}"]
        env = self.environment
        lines.append("  " + ", ".join(f"{k}={env[k]}" for k in sorted(env)))
        for c in self.checks:
            lines.append(f"[{c.status.upper():7s}] {c.name} ({c.seconds:.1f} s) {c.message}")
            for key, value in c.numbers.items():
                lines.append(f"            {key} = {_fmt(value)}")
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / JSON_NAME).write_text(json.dumps(self.as_dict(), indent=1, default=str))
        (self.out_dir / TEXT_NAME).write_text(self.summary())


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)

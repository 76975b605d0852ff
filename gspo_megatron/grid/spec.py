"""A grid: axes of config overrides, their Cartesian product as points, checked before anything
reaches sbatch, and ``grid.json``, the record every later command reads.

Each point is loaded as a config (``config.load_config`` with the common overrides and the
point's own), so an axis key the schema does not know or a value of the wrong type fails with the
config's own message, naming the point, before a job is queued.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
RECORD = "grid.json"


class GridError(ValueError):
    """A grid that cannot be submitted or read; the message names the axis, point or file."""


def parse_axis(text: str) -> Tuple[str, List[str]]:
    """``key=v1,v2`` -> (key, [v1, v2]); the error names the offending axis."""
    key, sep, values = text.partition("=")
    if not sep or not KEY_RE.match(key):
        raise GridError(f"axis {text!r}: expected KEY=V1,V2,... with a dotted config key")
    items = [v.strip() for v in values.split(",")]
    if not items or any(not v or "\n" in v for v in items):
        raise GridError(f"axis {text!r}: empty value (or a newline) in the list")
    if len(set(items)) != len(items):
        raise GridError(f"axis {text!r}: repeated value")
    return key, items


def expand_grid(axes: Sequence[Tuple[str, List[str]]], common: Sequence[str] = ()) -> List[List[str]]:
    """Every combination of axis values as override lists, the first axis varying slowest."""
    keys = [k for k, _ in axes]
    if len(set(keys)) != len(keys):
        raise GridError(f"an axis key appears twice: {keys}")
    return [list(common) + [f"{k}={v}" for k, v in zip(keys, combo)]
            for combo in itertools.product(*(vals for _, vals in axes))]


def check_points(config: str, points: Sequence[Sequence[str]], axes: Sequence[Tuple[str, List[str]]]) -> None:
    """Load every point's config; the first that fails raises naming the point and the key."""
    from gspo_megatron.config import ConfigError, load_config

    axis_keys = {k for k, _ in axes}
    for index, overrides in enumerate(points):
        try:
            load_config(config, list(overrides))
        except ConfigError as exc:
            own = [o for o in overrides if o.split("=", 1)[0] in axis_keys]
            raise GridError(f"grid point {index} ({' '.join(own)}) does not load with {config}: "
                            f"{exc}") from exc


def array_option(indices: Sequence[int], max_parallel: Optional[int]) -> str:
    """``--array=0-(N-1)`` for a whole grid, ``--array=i,j`` for some points; ``%M`` to run at
    most M tasks at once."""
    ordered = sorted(indices)
    if ordered == list(range(len(ordered))):
        spec = f"--array=0-{len(ordered) - 1}"
    else:
        spec = "--array=" + ",".join(str(i) for i in ordered)
    return f"{spec}%{max_parallel}" if max_parallel else spec


def write_points(grid_dir: Path, points: Sequence[Sequence[str]]) -> None:
    """One override per line in ``points/<i>.overrides`` (slurm/lib.sh reads it)."""
    folder = grid_dir / "points"
    folder.mkdir(parents=True, exist_ok=True)
    for i, overrides in enumerate(points):
        (folder / f"{i}.overrides").write_text("".join(f"{o}\n" for o in overrides))


@dataclass
class GridRecord:
    """``grid.json``: what was asked for and every job array submitted for it."""

    name: str
    script: str
    config: str
    axes: Dict[str, List[str]]
    points: List[dict]
    """``{index, overrides, run_dir}`` per point."""
    jobs: List[dict] = field(default_factory=list)
    """``{job_id, indices, submitted_at, command}`` per submission, oldest first."""

    def point_axes(self, index: int) -> Dict[str, str]:
        """The axis values of point ``index``."""
        values = dict(o.split("=", 1) for o in self.points[index]["overrides"])
        return {k: values[k] for k in self.axes}

    def latest_job(self, index: int) -> Optional[str]:
        """The Slurm id of the last array task that ran point ``index`` (``ID_i``), if any."""
        for job in reversed(self.jobs):
            if index in job["indices"] and job.get("job_id"):
                return f"{job['job_id']}_{index}"
        return None

    def add_job(self, job_id: Optional[str], indices: Sequence[int], command: Sequence[str]) -> None:
        self.jobs.append({"job_id": job_id, "indices": list(indices), "command": list(command),
                          "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})

    def write(self, grid_dir: Path) -> None:
        grid_dir.mkdir(parents=True, exist_ok=True)
        (grid_dir / RECORD).write_text(json.dumps(self.__dict__, indent=2) + "\n")

    @classmethod
    def read(cls, grid_dir: Path) -> "GridRecord":
        path = grid_dir / RECORD
        if not path.is_file():
            raise GridError(f"{grid_dir} is not a grid directory: it has no {RECORD} "
                            "(made by `gspo-grid submit`)")
        try:
            data = json.loads(path.read_text())
            return cls(name=data["name"], script=data["script"], config=data["config"],
                       axes=data["axes"], points=data["points"], jobs=data.get("jobs", []))
        except (ValueError, KeyError, TypeError) as exc:
            raise GridError(f"{path}: not a grid record ({type(exc).__name__}: {exc})") from exc

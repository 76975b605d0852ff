"""Submit a grid of config overrides as one Slurm job array (a scaling or ablation study).

    python -m pipelines.submit_grid --grid-dir runs/lr_sweep --script slurm/gspo_30b.sh \
        --axis optimizer.lr=5e-7,1e-6,2e-6 --axis batch.num_prompts_per_step=128,256 \
        [--max-parallel 2] [--sbatch-arg=--nodes=8 ...] [-- common.overrides ...]

The grid is the Cartesian product of the axes (values split on commas). Point i gets its
overrides in ``<grid dir>/points/i.overrides`` (one per line, the common ones first) and its
run directory ``<grid dir>/point_i``; array task i of the job reads them (slurm/lib.sh). The axes,
points, command and job id are recorded in ``<grid dir>/grid.json``. Exit codes: 0 submitted,
1 sbatch failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from pipelines.sbatch import REPO_ROOT, Submission, SubmitError, submit, write_record

logger = logging.getLogger("submit_grid")

KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass
class GridSpec:
    """A job array: batch script, where points live, axes and options."""

    grid_dir: Path
    script: str
    axes: List[Tuple[str, List[str]]]
    common_overrides: Sequence[str] = ()
    max_parallel: Optional[int] = None
    sbatch_args: Sequence[str] = ()


def parse_axis(text: str) -> Tuple[str, List[str]]:
    """``key=v1,v2`` -> (key, [v1, v2]); the error names the offending axis."""
    key, sep, values = text.partition("=")
    if not sep or not KEY_RE.match(key):
        raise ValueError(f"axis {text!r}: expected KEY=V1,V2,... with a dotted config key")
    items = [v.strip() for v in values.split(",")]
    if not items or any(not v or "\n" in v for v in items):
        raise ValueError(f"axis {text!r}: empty value (or a newline) in the list")
    if len(set(items)) != len(items):
        raise ValueError(f"axis {text!r}: repeated value")
    return key, items


def expand_grid(axes: Sequence[Tuple[str, List[str]]], common: Sequence[str] = ()) -> List[List[str]]:
    """Every combination of axis values as override lists, the first axis varying slowest."""
    keys = [k for k, _ in axes]
    if len(set(keys)) != len(keys):
        raise ValueError(f"an axis key appears twice: {keys}")
    return [list(common) + [f"{k}={v}" for k, v in zip(keys, combo)]
            for combo in itertools.product(*(vals for _, vals in axes))]


def array_option(num_points: int, max_parallel: Optional[int]) -> str:
    """``--array=0-(N-1)`` with ``%M`` to run at most M tasks at once."""
    spec = f"--array=0-{num_points - 1}"
    return f"{spec}%{max_parallel}" if max_parallel else spec


def write_points(grid_dir: Path, points: Sequence[Sequence[str]]) -> None:
    folder = grid_dir / "points"
    folder.mkdir(parents=True, exist_ok=True)
    for i, overrides in enumerate(points):
        (folder / f"{i}.overrides").write_text("".join(f"{o}\n" for o in overrides))


def build_submission(spec: GridSpec, num_points: int) -> Submission:
    grid_dir = str(spec.grid_dir.resolve())
    cmd = ["sbatch", "--parsable", array_option(num_points, spec.max_parallel),
           f"--output={grid_dir}/logs/%x-%A_%a.out", *spec.sbatch_args, spec.script]
    return Submission(name="grid", command=cmd, env={"GSPO_GRID_DIR": grid_dir, "GSPO_REPO": str(REPO_ROOT)})


def submit_grid(spec: GridSpec, runner=None) -> Tuple[Submission, List[List[str]]]:
    """Write the points, submit the array, record everything in grid.json."""
    points = expand_grid(spec.axes, spec.common_overrides)
    write_points(spec.grid_dir, points)
    (spec.grid_dir / "logs").mkdir(parents=True, exist_ok=True)
    sub = build_submission(spec, len(points))
    try:
        submit(sub, **({} if runner is None else {"runner": runner}))
    finally:
        write_record(spec.grid_dir / "grid.json", {
            "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "script": spec.script,
            "axes": {k: v for k, v in spec.axes},
            "points": [{"index": i, "overrides": p, "run_dir": str(spec.grid_dir.resolve() / f"point_{i}")}
                       for i, p in enumerate(points)],
            "job": sub,
        })
    return sub, points


def parse_args(argv: Sequence[str]) -> GridSpec:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid-dir", required=True, type=Path, help="directory of the whole study")
    parser.add_argument("--script", default="slurm/gspo_30b.sh", help="batch script of one point")
    parser.add_argument("--axis", action="append", required=True, help="KEY=V1,V2,... (repeatable)")
    parser.add_argument("--max-parallel", type=int, help="array tasks running at once")
    parser.add_argument("--sbatch-arg", action="append", default=[], help="sbatch option (repeatable)")
    parser.add_argument("overrides", nargs="*", help="overrides common to every point (after --)")
    args = parser.parse_args(argv)
    try:
        axes = [parse_axis(a) for a in args.axis]
        expand_grid(axes)
    except ValueError as exc:
        parser.error(str(exc))
    script = args.script
    if Path(script).is_file():
        script = str(Path(script).resolve())  # sbatch runs from the repository root
    elif not (REPO_ROOT / script).is_file():
        parser.error(f"--script: file not found: {args.script}")
    if args.max_parallel is not None and args.max_parallel < 1:
        parser.error("--max-parallel must be at least 1")
    return GridSpec(grid_dir=args.grid_dir, script=script, axes=axes, common_overrides=args.overrides,
                    max_parallel=args.max_parallel, sbatch_args=args.sbatch_arg)


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        sub, points = submit_grid(spec)
    except SubmitError as exc:
        logger.error("error: %s", exc)
        return 1
    logger.info("job array %s: %d points, recorded in %s", sub.job_id, len(points),
                spec.grid_dir / "grid.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``gspo-grid``: a scaling or ablation study as one Slurm job array, and its results in one table.

    gspo-grid submit --grid-dir runs/lr_sweep [--script slurm/gspo_30b.sh] [--config CONFIG] \\
        --axis optimizer.lr=5e-7,1e-6,2e-6 --axis batch.num_prompts_per_step=128,256 \\
        [--max-parallel 2] [--sbatch-arg=--nodes=8 ...] [--max-points 64 | --yes] [-- common overrides]
    gspo-grid submit --resume runs/lr_sweep [--max-parallel 2] [--sbatch-arg ...]
    gspo-grid report runs/lr_sweep [--metric final_accuracy] [--last 5]

``submit`` loads every point's config first (an unknown key or a value of the wrong type is
refused naming the point, before sbatch), then writes ``points/<i>.overrides``, submits the array
(point i runs in ``<grid dir>/point_i``; ``slurm/lib.sh`` reads both) and records everything in
``grid.json``. Every point's wandb run is in the group named after the grid, named
``<grid>-p<i>``, with the point's config (axis values included). ``--resume`` resubmits only the
points that failed or are missing, as a new array job recorded in ``grid.json``. ``report``
writes ``report.md``, ``report.csv`` and PNG figures into the grid directory
(``grid/report.py``); it works while the grid runs. Exit codes: 0 done, 1 sbatch failed, 2 bad
usage or a bad grid (the message names the axis, point or file).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from gspo_megatron.grid.sbatch import REPO_ROOT, Submission, SubmitError, submit
from gspo_megatron.grid.spec import (GridError, GridRecord, array_option, check_points,
                                     expand_grid, parse_axis, write_points)
from gspo_megatron.grid.state import PointState, point_state, scheduler_tasks

log = logging.getLogger("gspo-grid")
EXIT_SUBMIT, EXIT_USAGE = 1, 2
RESUBMIT = ("failed", "missing")
"""Point states ``submit --resume`` runs again."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gspo-grid", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", help="submit a grid (or --resume its failed / missing points)")
    s.add_argument("--grid-dir", type=Path, help="directory of the whole study")
    s.add_argument("--resume", type=Path, metavar="GRID_DIR",
                   help="resubmit the failed or missing points of this grid")
    s.add_argument("--name", help="the grid's name (wandb group); default: the directory's name")
    s.add_argument("--script", default="slurm/gspo_30b.sh", help="batch script of one point")
    s.add_argument("--config", help="config the script trains (default: its GSPO_CONFIG default)")
    s.add_argument("--axis", action="append", default=[], help="KEY=V1,V2,... (repeatable)")
    s.add_argument("--max-parallel", type=int, help="array tasks running at once")
    s.add_argument("--sbatch-arg", action="append", default=[], help="sbatch option (repeatable)")
    s.add_argument("--max-points", type=int, default=64, help="refuse larger grids without --yes")
    s.add_argument("--yes", action="store_true", help="submit a grid larger than --max-points")
    s.add_argument("overrides", nargs="*", help="overrides common to every point (after --)")
    r = sub.add_parser("report", help="table, CSV and figures of a grid, written into its directory")
    r.add_argument("grid_dir", type=Path)
    r.add_argument("--metric", choices=("final_accuracy", "final_reward", "best_accuracy", "s_per_step",
                                        "gen_tokens_per_s", "peak_memory_gb", "clip_frac_seq",
                                        "clip_frac_token"),
                   help="what the figures plot (default: final accuracy if evaluated, else reward)")
    r.add_argument("--last", type=int, default=5, help="RL steps the final reward averages over")
    return parser


def script_path(script: str) -> str:
    """As given when it lies in the checkout (sbatch runs there), else absolute."""
    if not Path(script).is_absolute() and (REPO_ROOT / script).is_file():
        return script
    if Path(script).is_file():
        return str(Path(script).resolve())
    raise GridError(f"--script: file not found: {script}")


def default_config(script: str) -> str:
    """The ``GSPO_CONFIG=${GSPO_CONFIG:-...}`` default of a batch script."""
    path = Path(script) if Path(script).is_absolute() else REPO_ROOT / script
    match = re.search(r"GSPO_CONFIG=\$\{GSPO_CONFIG:-([^}]+)\}", path.read_text())
    if not match:
        raise GridError(f"{script} sets no GSPO_CONFIG default: pass --config")
    return match.group(1)


def profile_overrides(script: str) -> List[str]:
    """The ``GSPO_PROFILE_OVERRIDES=(...)`` a batch script puts before the user's overrides
    (slurm/tiny_cpu.sh: reference servers, the broadcast transport...), so that each point is
    checked as the job will load it."""
    path = Path(script) if Path(script).is_absolute() else REPO_ROOT / script
    match = re.search(r"GSPO_PROFILE_OVERRIDES=\(([^)]*)\)", path.read_text())
    return match.group(1).split() if match else []


def _config_path(config: str) -> str:
    return config if Path(config).is_absolute() else str(REPO_ROOT / config)


def _submit(record: GridRecord, grid_dir: Path, indices: Sequence[int], max_parallel: Optional[int],
            sbatch_args: Sequence[str]) -> Submission:
    """One array job over ``indices``, recorded in grid.json whether sbatch succeeded or not."""
    grid = str(grid_dir.resolve())
    cmd = ["sbatch", "--parsable", array_option(indices, max_parallel),
           f"--output={grid}/logs/%x-%A_%a.out", *sbatch_args, record.script]
    sub = Submission(name="grid", command=cmd, env={"GSPO_GRID_DIR": grid, "GSPO_REPO": str(REPO_ROOT),
                                                    "GSPO_CONFIG": record.config})
    (grid_dir / "logs").mkdir(parents=True, exist_ok=True)
    try:
        submit(sub)
    finally:
        record.add_job(sub.job_id, indices, cmd)
        record.write(grid_dir)
    return sub


def submit_new(args) -> int:
    if not args.grid_dir or not args.axis:
        raise GridError("submit needs --grid-dir and at least one --axis (or --resume GRID_DIR)")
    grid_dir: Path = args.grid_dir
    if (grid_dir / "grid.json").exists():
        raise GridError(f"{grid_dir} already holds a grid: `gspo-grid submit --resume {grid_dir}` "
                        "reruns its failed points, or choose another --grid-dir")
    axes = [parse_axis(a) for a in args.axis]
    script = script_path(args.script)
    config = args.config or default_config(script)
    if not Path(_config_path(config)).is_file():
        raise GridError(f"--config: file not found: {config}")
    name = args.name or grid_dir.resolve().name
    common = [f"logging.wandb.group={name}", *args.overrides]
    points = expand_grid(axes, common)
    if len(points) > args.max_points and not args.yes:
        raise GridError(f"the grid has {len(points)} points, more than --max-points={args.max_points}: "
                        "pass --yes to submit it anyway, or fewer axis values")
    points = [p + [f"logging.wandb.name={name}-p{i}"] for i, p in enumerate(points)]
    profile = profile_overrides(script)
    check_points(_config_path(config), [profile + p for p in points], axes)
    write_points(grid_dir, points)
    record = GridRecord(name=name, script=script, config=config, axes={k: v for k, v in axes},
                        points=[{"index": i, "overrides": p, "run_dir": str(grid_dir.resolve() / f"point_{i}")}
                                for i, p in enumerate(points)])
    sub = _submit(record, grid_dir, range(len(points)), args.max_parallel, args.sbatch_arg)
    log.info("job array %s: %d points, recorded in %s", sub.job_id, len(points), grid_dir / "grid.json")
    return 0


def point_states(record: GridRecord) -> Dict[int, PointState]:
    """Every point's state (``grid/state.py``)."""
    arrays = sorted({j["job_id"] for j in record.jobs if j.get("job_id")})
    tasks = scheduler_tasks(arrays)
    known = bool(tasks)
    out = {}
    for point in record.points:
        i = point["index"]
        slurm_id = record.latest_job(i)
        out[i] = point_state(Path(point["run_dir"]), slurm_id, tasks.get(slurm_id), known)
    return out


def submit_resume(args) -> int:
    grid_dir: Path = args.resume
    record = GridRecord.read(grid_dir)
    states = point_states(record)
    again = [i for i, s in sorted(states.items()) if s.state in RESUBMIT]
    if not again:
        log.info("nothing to resubmit in %s: %s", grid_dir,
                 ", ".join(f"{i} {s.state}" for i, s in sorted(states.items())))
        return 0
    sub = _submit(record, grid_dir, again, args.max_parallel, args.sbatch_arg)
    log.info("job array %s: resubmitted points %s (%s), recorded in %s", sub.job_id, again,
             ", ".join(states[i].state for i in again), grid_dir / "grid.json")
    return 0


def report(args) -> int:
    from gspo_megatron.grid.report import write_report

    record = GridRecord.read(args.grid_dir)
    rows = write_report(args.grid_dir, record, point_states(record), args.metric, args.last)
    counts: Dict[str, int] = {}
    for row in rows:
        counts[row.state.state] = counts.get(row.state.state, 0) + 1
    log.info("%s: %d points (%s); wrote report.md, report.csv and figures", args.grid_dir, len(rows),
             ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "report":
            return report(args)
        if args.max_parallel is not None and args.max_parallel < 1:
            raise GridError("--max-parallel must be at least 1")
        return submit_resume(args) if args.resume else submit_new(args)
    except GridError as exc:
        log.error("gspo-grid: %s", exc)
        return EXIT_USAGE
    except SubmitError as exc:
        log.error("gspo-grid: %s", exc)
        return EXIT_SUBMIT


if __name__ == "__main__":
    sys.exit(main())

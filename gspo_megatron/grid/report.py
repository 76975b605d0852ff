"""One table and a few figures for a whole grid, from ``grid.json`` and every point's run
directory, written into the grid directory (``report.md``, ``report.csv``, ``*.png``) each time it
runs, so it also works while the grid is still running.

Per point: its axis values and state, the step reached, final and best held-out accuracy
(``eval/accuracy``), the reward over the last N RL steps (``reward/mean``), the sequence and
token clip fractions over the same steps, the median seconds per step (``time/step_s``), the
mean generated tokens per second (``rollout/tokens_per_s``) and the peak memory
(``memory/peak_gb``). Figures: the chosen metric against each axis (one line per combination of
the other axes) and every point's reward curve on one plot.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from gspo_megatron.grid.spec import GridRecord
from gspo_megatron.grid.state import PointState

COLUMNS = ("point", "state", "step", "final_accuracy", "best_accuracy", "final_reward",
           "clip_frac_seq", "clip_frac_token", "s_per_step", "gen_tokens_per_s", "peak_memory_gb")
METRICS = ("final_accuracy", "final_reward", "best_accuracy", "s_per_step", "gen_tokens_per_s",
           "peak_memory_gb", "clip_frac_seq", "clip_frac_token")


@dataclass
class PointRow:
    """One row of the table (None: not logged, or nothing ran yet)."""

    index: int
    axes: Dict[str, str]
    state: PointState
    values: Dict[str, Optional[float]] = field(default_factory=dict)
    rewards: List[tuple] = field(default_factory=list)
    """``(step, reward/mean)`` of every RL step, for the curves."""


def read_metrics(run_dir: Path) -> List[dict]:
    """The rows of ``metrics.jsonl`` (a partly written last line is skipped: the run is live)."""
    path = run_dir / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def summarize(rows: Sequence[dict], last: int) -> Dict[str, Optional[float]]:
    """The table's numbers from one point's metrics rows."""
    rl = [r for r in rows if "reward/mean" in r]
    tail = rl[-last:]
    acc = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    col = lambda key, rs=tail: [r[key] for r in rs if key in r]  # noqa: E731
    step_s = col("time/step_s", rl)
    peak = col("memory/peak_gb", rows)
    return {"step": float(max((r.get("step", 0) for r in rows), default=0)) if rows else None,
            "final_accuracy": acc[-1] if acc else None,
            "best_accuracy": max(acc) if acc else None,
            "final_reward": _mean(col("reward/mean")),
            "clip_frac_seq": _mean(col("train/clip_frac_seq")),
            "clip_frac_token": _mean(col("train/clip_frac_token")),
            "s_per_step": statistics.median(step_s) if step_s else None,
            "gen_tokens_per_s": _mean(col("rollout/tokens_per_s", rl)),
            "peak_memory_gb": max(peak) if peak else None}


def build_rows(record: GridRecord, states: Dict[int, PointState], last: int) -> List[PointRow]:
    rows = []
    for point in record.points:
        i = point["index"]
        metrics = read_metrics(Path(point["run_dir"]))
        rows.append(PointRow(i, record.point_axes(i), states[i], summarize(metrics, last),
                             [(r["step"], r["reward/mean"]) for r in metrics if "reward/mean" in r]))
    return rows


def _fmt(value: Optional[float], key: str) -> str:
    if value is None:
        return "-"
    if key == "step":
        return str(int(value))
    if key in ("s_per_step", "gen_tokens_per_s", "peak_memory_gb"):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return f"{value:.4f}"


def _state_text(state: PointState) -> str:
    if state.state == "failed":
        code = "?" if state.exit_code is None else state.exit_code
        return f"failed (exit {code}): {state.error}" if state.error else f"failed (exit {code})"
    return state.state


def write_csv(path: Path, record: GridRecord, rows: Sequence[PointRow]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["point", *record.axes, "state", "exit_code", "error", *COLUMNS[2:]])
        for row in rows:
            writer.writerow([row.index, *row.axes.values(), row.state.state,
                             "" if row.state.exit_code is None else row.state.exit_code,
                             row.state.error, *("" if row.values.get(k) is None else row.values[k]
                                                for k in COLUMNS[2:])])


def markdown(record: GridRecord, rows: Sequence[PointRow], metric: str, last: int,
             figures: Sequence[str]) -> str:
    counts: Dict[str, int] = {}
    for row in rows:
        counts[row.state.state] = counts.get(row.state.state, 0) + 1
    header = ["point", *record.axes, "state", *COLUMNS[2:]]
    lines = [f"# Grid `{record.name}`", "",
             f"Written by `gspo-grid report` at {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; "
             f"{len(rows)} points: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ".",
             f"Config `{record.config}`, script `{record.script}`; reward and clip fractions are "
             f"means over the last {last} RL steps, seconds per step the median.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in sorted(rows, key=lambda r: (r.values.get(metric) is None, -(r.values.get(metric) or 0))):
        cells = [str(row.index), *(f"`{v}`" for v in row.axes.values()), _state_text(row.state),
                 *(_fmt(row.values.get(k), k) for k in COLUMNS[2:])]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    lines += ["", f"Rows ordered by `{metric}`, best first."]
    lines += [f"\n![{name}]({name})" for name in figures]
    return "\n".join(lines) + "\n"


def _numeric(values: Sequence[str]) -> Optional[List[float]]:
    try:
        return [float(v) for v in values]
    except ValueError:
        return None


def _slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_")


def write_figures(grid_dir: Path, record: GridRecord, rows: Sequence[PointRow], metric: str) -> List[str]:
    """``<metric>_vs_<axis>.png`` per axis and ``reward_curves.png``; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for axis, values in record.axes.items():
        others = [k for k in record.axes if k != axis]
        numeric = _numeric(values)
        xs = dict(zip(values, numeric)) if numeric else {v: i for i, v in enumerate(values)}
        fig, ax = plt.subplots(figsize=(6, 4))
        groups: Dict[tuple, List[tuple]] = {}
        for row in rows:
            if row.values.get(metric) is not None:
                key = tuple(row.axes[k] for k in others)
                groups.setdefault(key, []).append((xs[row.axes[axis]], row.values[metric]))
        for key, points in sorted(groups.items()):
            points.sort()
            label = ", ".join(f"{k}={v}" for k, v in zip(others, key)) or metric
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        if numeric and min(numeric) > 0 and max(numeric) / min(numeric) >= 10:
            ax.set_xscale("log")
            ax.minorticks_off()
        ax.set_xticks(list(xs.values()), list(xs))  # the values as the user wrote them
        ax.set_xlabel(axis)
        ax.set_ylabel(metric)
        ax.set_title(f"{record.name}: {metric} against {axis}")
        if groups:
            ax.legend(fontsize=7)
        name = f"{metric}_vs_{_slug(axis)}.png"
        fig.tight_layout()
        fig.savefig(grid_dir / name, dpi=100)
        plt.close(fig)
        names.append(name)
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        if row.rewards:
            label = f"{row.index}: " + ", ".join(f"{k}={v}" for k, v in row.axes.items())
            ax.plot([s for s, _ in row.rewards], [r for _, r in row.rewards], label=label)
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward/mean")
    ax.set_title(f"{record.name}: reward of every point")
    if any(row.rewards for row in rows):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(grid_dir / "reward_curves.png", dpi=100)
    plt.close(fig)
    return names + ["reward_curves.png"]


def choose_metric(rows: Sequence[PointRow], metric: Optional[str]) -> str:
    """The asked metric, else held-out accuracy when any point has it, else the reward."""
    if metric:
        return metric
    return "final_accuracy" if any(r.values.get("final_accuracy") is not None for r in rows) \
        else "final_reward"


def write_report(grid_dir: Path, record: GridRecord, states: Dict[int, PointState],
                 metric: Optional[str] = None, last: int = 5) -> List[PointRow]:
    """Write ``report.md``, ``report.csv`` and the figures into ``grid_dir``; return the rows."""
    rows = build_rows(record, states, last)
    metric = choose_metric(rows, metric)
    figures = write_figures(grid_dir, record, rows, metric)
    write_csv(grid_dir / "report.csv", record, rows)
    (grid_dir / "report.md").write_text(markdown(record, rows, metric, last, figures))
    return rows

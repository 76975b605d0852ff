"""The reproduction's figure and table, from ``{variant: {seed: metrics rows}}``.

Figure (one PNG, x = rollout samples generated): held-out greedy accuracy and training reward
(median over seeds, band = min..max), token clip fraction (log scale: the paper's Fig. 2 claim is
about two orders of magnitude between GSPO and GRPO), expert volatility (activated experts that
change after the step's updates), the spread of the sequence log-ratios, and KL(old || new).
Table (markdown): per variant, final held-out accuracy median (min-max) over seeds, the best
evaluation, late training reward, and run means of the diagnostics.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence

Runs = Dict[str, Dict[int, List[dict]]]
PANELS = (
    ("held-out accuracy (greedy, 200 problems)", "eval/accuracy", False, 1),
    ("training reward (mean of 10 steps)", "reward/mean", False, 10),
    ("clipped tokens (fraction, mean of 10 steps)", "train/clip_frac_token", True, 10),
    ("activated experts changed per step (mean of 10)", "routing/activated_expert_changed_frac",
     False, 10),
    ("mean |sequence log-ratio| (mean of 10 steps)", "train/seq_log_ratio_abs_mean", True, 10),
    ("KL(old || new) per token (mean of 10 steps)", "train/approx_kl", True, 10),
)


def series(rows: List[dict], key: str, window: int = 1) -> List[tuple]:
    """``(step, value)`` of ``key``; with ``window > 1`` a trailing mean over that many rows."""
    points = [(r["step"], r[key]) for r in rows if key in r]
    if window <= 1:
        return points
    out = []
    for i, (step, _) in enumerate(points):
        chunk = [v for _, v in points[max(0, i - window + 1):i + 1]]
        out.append((step, sum(chunk) / len(chunk)))
    return out


def across_seeds(per_seed: Dict[int, List[dict]], key: str, window: int = 1):
    """Steps present in every seed, with the median, min and max over seeds."""
    curves = [dict(series(rows, key, window)) for rows in per_seed.values()]
    curves = [c for c in curves if c]
    if not curves:
        return [], [], [], []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    values = [[c[s] for c in curves] for s in steps]
    return (steps, [statistics.median(v) for v in values], [min(v) for v in values],
            [max(v) for v in values])


def plot_comparison(runs: Runs, path: Path, samples_per_step: int) -> Path:
    """Write the comparison figure (see module docstring) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, key, log_y, window) in zip(axes.flat, PANELS):
        for variant, per_seed in runs.items():
            steps, med, low, high = across_seeds(per_seed, key, window)
            if not steps:
                continue
            xs = [s * samples_per_step for s in steps]
            line, = ax.plot(xs, med, label=variant, linewidth=1.3)
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("rollout samples")
        if log_y and any(y > 0 for line in ax.lines for y in line.get_ydata()):
            ax.set_yscale("log")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(f"GSPO vs GRPO on a tiny MoE (8 experts, top-2): median over "
                 f"{max(len(p) for p in runs.values())} seeds, band = min..max", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _run_mean(rows: List[dict], key: str, last: Optional[int] = None) -> Optional[float]:
    values = [r[key] for r in rows if key in r and r.get("step", 0) > 0]
    if last:
        values = values[-last:]
    return sum(values) / len(values) if values else None


def _fmt(values: Sequence[Optional[float]], spec: str, spread: bool = False) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    med = format(statistics.median(values), spec)
    return f"{med} ({format(min(values), spec)}-{format(max(values), spec)})" if spread else med


def comparison_table(runs: Runs) -> str:
    """Markdown table, one row per variant (values: median over seeds; ranges: min-max)."""
    head = ("| variant | held-out acc. at the end | best held-out acc. | reward, last 20 steps "
            "| clipped tokens | clipped seqs | activated experts changed | mean abs seq log-ratio "
            "| learner vs engine abs logp | s / step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for variant, per_seed in runs.items():
        rows = list(per_seed.values())
        final = [next((r["eval/accuracy"] for r in reversed(x) if "eval/accuracy" in r), None)
                 for x in rows]
        best = [max((r["eval/accuracy"] for r in x if "eval/accuracy" in r), default=None)
                for x in rows]
        cells = [
            _fmt(final, ".3f", spread=True), _fmt(best, ".3f", spread=True),
            _fmt([_run_mean(x, "reward/mean", last=20) for x in rows], ".3f", spread=True),
            _fmt([_run_mean(x, "train/clip_frac_token") for x in rows], ".2e"),
            _fmt([_run_mean(x, "train/clip_frac_seq") for x in rows], ".2e"),
            _fmt([_run_mean(x, "routing/activated_expert_changed_frac") for x in rows], ".3f"),
            _fmt([_run_mean(x, "train/seq_log_ratio_abs_mean") for x in rows], ".2e"),
            _fmt([_run_mean(x, "rollout/learner_vs_engine_abs_logp") for x in rows], ".1e"),
            _fmt([_run_mean(x, "time/step_s") for x in rows], ".2f"),
        ]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

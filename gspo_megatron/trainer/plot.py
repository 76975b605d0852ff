"""A PNG summary of one run, from its ``metrics.jsonl`` rows.

Time series against the RL step: reward and held-out accuracy, clip fractions (token low / high,
token, sequence), KL(old || new), entropy, response length, expert volatility (MoE) and the spread
of the sequence log-ratios (all sequences, and per response-length bucket). Two panels summarise
the whole run per response-length bucket (``algorithms/length_diagnostics.py``): the clip
fractions, and the histogram of sequence log-ratios ``mean_t(log pi - log pi_old)``. With
``rollout.max_staleness >= 2``: the mean token lag, samples spanning versions, the pause per
sync, dropped groups and the clip fraction by lag. Only the panels a run has data for are drawn
(``panels_with_data``): an on-policy run shows no asynchrony panels, a dense model no expert
volatility, a run without length buckets no per-length summaries.

    plot_history(rows, "runs/x/metrics.png", bin_edges=cfg.algo.diagnostics.log_ratio_bin_edges)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence

PANELS = (
    ("reward", ("reward/mean", "eval/accuracy")),
    ("clip fractions", ("train/clip_frac_token_low", "train/clip_frac_token_high",
                        "train/clip_frac_token", "train/clip_frac_seq")),
    ("KL(old || new) per token", ("train/approx_kl",)),
    ("entropy", ("train/entropy",)),
    ("response length", ("rollout/response_len_mean",)),
    ("expert volatility (MoE)", ("routing/expert_set_changed_frac",
                                 "routing/activated_expert_changed_frac")),
    ("mean |seq log-ratio|", ("train/seq_log_ratio_abs_mean",)),
    ("asynchrony (max_staleness >= 2)", ("async/lag_mean", "async/multi_version_sample_frac",
                                         "weight_sync/pause_s")),
    ("groups dropped per step", ("async/dropped_stale_groups",
                                 "async/dropped_zero_variance_groups")),
    ("clipped tokens by lag", tuple(f"train/clip_frac_token_lag{j}" for j in range(4))
     + ("train/clip_frac_token_lag4plus",)),
)
BUCKET = re.compile(r"^train/len_([^/]+)/(.+)$")


def _bucket_upper(label: str) -> float:
    """Upper end of a bucket label of ``length_diagnostics.bucket_labels`` (for ordering)."""
    if label.startswith("gt"):
        return float("inf")
    return float(label[2:] if label.startswith("le") else label.split("to")[-1])


def bucket_names(history: List[Dict[str, float]]) -> List[str]:
    """Length-bucket labels found in the rows, shortest responses first."""
    names = {m.group(1) for row in history for key in row for m in [BUCKET.match(key)] if m}
    return sorted(names, key=_bucket_upper)


def run_mean(history: List[Dict[str, float]], key: str) -> Optional[float]:
    """Mean of ``key`` over the rows that have it (None when none does)."""
    values = [row[key] for row in history if key in row]
    return sum(values) / len(values) if values else None


def _series(ax, history, keys, title: str) -> None:
    for key in keys:
        points = [(row["step"], row[key]) for row in history if key in row]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(points) <= 100 else None, markersize=2,
                    linewidth=1 if len(points) <= 100 else 0.6, label=key.split("/", 1)[-1])
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    if ax.lines:
        ax.legend(fontsize=6)


def _clip_by_length(ax, history, buckets) -> None:
    width = 0.4
    for offset, (what, label) in enumerate((("clip_frac_token", "tokens"),
                                            ("clip_frac_seq", "sequences"))):
        values = [run_mean(history, f"train/len_{b}/{what}") or 0.0 for b in buckets]
        ax.bar([i + (offset - 0.5) * width for i in range(len(buckets))], values, width,
               label=label)
    ax.set_xticks(range(len(buckets)))
    ax.set_xticklabels(buckets, fontsize=7)
    ax.set_title(CLIP_BY_LENGTH, fontsize=9)
    if buckets:
        ax.legend(fontsize=6)


def _histograms(ax, history, buckets, bin_edges: Optional[Sequence[float]]) -> None:
    for b in buckets:
        prefix = f"train/len_{b}/log_ratio_hist"
        keys = sorted({k for row in history for k in row if k.startswith(prefix)},
                      key=lambda k: int(k[len(prefix):]))
        values = [run_mean(history, k) for k in keys]
        if keys and any(v for v in values if v is not None):
            ax.plot(range(len(keys)), [v or 0.0 for v in values], marker="o", markersize=3,
                    label=f"len {b}")
    if bin_edges is not None:
        e = [f"{x:.0e}" if x else "0" for x in bin_edges]
        labels = [f"<{e[0]}"] + [f"[{a},{b})" for a, b in zip(e[:-1], e[1:])] + [f">={e[-1]}"]
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=6, rotation=45, ha="right")
    ax.set_title(HISTOGRAMS, fontsize=9)
    if ax.lines:
        ax.legend(fontsize=6)


def panels_with_data(history: List[Dict[str, float]], panels: Sequence = PANELS) -> List[str]:
    """Titles of the panels ``plot_history`` draws for ``history``, in order: each time-series
    panel with at least one of its metrics in some row, then the three per-length-bucket panels
    when the rows have length buckets."""
    present = {key for row in history for key in row}
    titles = [title for title, keys in panels if present.intersection(keys)]
    if bucket_names(history):
        titles += [SPREAD, CLIP_BY_LENGTH, HISTOGRAMS]
    return titles


SPREAD = "spread by response length"
CLIP_BY_LENGTH = "clipped, by response length (run mean)"
HISTOGRAMS = "seq log-ratio histogram (run mean)"


def plot_history(history: List[Dict[str, float]], path: str | Path, panels: Sequence = PANELS,
                 bin_edges: Optional[Sequence[float]] = None) -> Path:
    """Write the summary figure to ``path`` (parents created) and return it: the panels of
    ``panels_with_data`` (a run with none yet gets one empty reward panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = bucket_names(history)
    series = dict(panels)
    series[SPREAD] = tuple(f"train/len_{b}/log_ratio_abs_mean" for b in buckets)
    titles = panels_with_data(history, panels) or [panels[0][0]]
    cols = min(5, len(titles))
    rows = -(-len(titles) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
    axes = list(axes.flat)
    for ax, title in zip(axes, titles):
        if title == CLIP_BY_LENGTH:
            _clip_by_length(ax, history, buckets)
        elif title == HISTOGRAMS:
            _histograms(ax, history, buckets, bin_edges)
        else:
            _series(ax, history, series[title], title)
    for ax in axes[len(titles):]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

"""A PNG summary of a run: reward / accuracy, clip fractions, KL, entropy and response length."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence

PANELS = (
    ("reward", ("reward/mean", "eval/accuracy")),
    ("clipping", ("train/clip_frac_token_low", "train/clip_frac_token_high", "train/clip_frac_seq")),
    ("KL(old || new)", ("train/approx_kl",)),
    ("entropy", ("train/entropy",)),
    ("response length", ("rollout/response_len_mean",)),
)


def plot_history(history: List[Dict[str, float]], path: str | Path,
                 panels: Sequence = PANELS) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            points = [(row["step"], row[key]) for row in history if key in row]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", markersize=3, label=key.split("/", 1)[-1])
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

"""The run summary figure: bucket discovery, run means, and a PNG from synthetic rows."""

from __future__ import annotations

from gspo_megatron.trainer.plot import (CLIP_BY_LENGTH, HISTOGRAMS, PANELS, SPREAD, bucket_names,
                                        panels_with_data, plot_history, run_mean)


def _rows():
    rows = [{"step": 0, "eval/accuracy": 0.2}]
    for step in range(1, 6):
        rows.append({"step": step, "reward/mean": 0.1 * step, "train/clip_frac_token": 0.01,
                     "train/clip_frac_seq": 0.02, "routing/expert_set_changed_frac": 0.1,
                     "train/len_le2/clip_frac_token": 0.1, "train/len_le2/clip_frac_seq": 0.2,
                     "train/len_gt4/seq_frac": 0.1, "train/len_3to4/clip_frac_seq": 0.3, "train/len_le2/log_ratio_hist0": 0.5,
                     "train/len_le2/log_ratio_hist1": 0.5, "train/len_3to4/log_ratio_hist1": 1.0,
                     "train/len_le2/log_ratio_abs_mean": 1e-3 * step})
    return rows


def test_buckets_in_order_and_run_means():
    rows = _rows()
    assert bucket_names(rows) == ["le2", "3to4", "gt4"]  # by length, not alphabetically
    assert abs(run_mean(rows, "reward/mean") - 0.3) < 1e-12
    assert run_mean(rows, "no/such") is None


def test_plot_writes_a_png(tmp_path):
    path = plot_history(_rows(), tmp_path / "sub" / "metrics.png", bin_edges=[-1e-3, 0.0])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    # A run without any diagnostics (dense, nothing logged yet) still plots.
    assert plot_history([{"step": 0}], tmp_path / "empty.png").is_file()


def test_only_the_panels_a_run_has_are_drawn():
    """An on-policy run (``make demo``) logs no ``async/*`` metric: its figure has no asynchrony,
    dropped-groups or lag panels; a k-stale run's has them."""
    on_policy = panels_with_data(_rows())
    assert on_policy == ["reward", "clip fractions", "expert volatility (MoE)",
                         SPREAD, CLIP_BY_LENGTH, HISTOGRAMS]
    stale = [dict(r, **{"async/lag_mean": 1.0, "async/dropped_stale_groups": 0.0,
                        "train/clip_frac_token_lag2": 0.1}) for r in _rows()]
    assert {"asynchrony (max_staleness >= 2)", "groups dropped per step",
            "clipped tokens by lag"} <= set(panels_with_data(stale))
    assert panels_with_data([{"step": 0}]) == []
    assert [t for t, _ in PANELS][:1] == ["reward"]


def test_the_figure_has_one_axis_per_drawn_panel(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    drawn = []
    real = plt.subplots

    def counting(rows, cols, **kw):
        fig, axes = real(rows, cols, **kw)
        drawn.append(fig)
        return fig, axes
    monkeypatch.setattr(plt, "subplots", counting)
    plot_history(_rows(), tmp_path / "a.png")
    visible = [ax for ax in drawn[0].axes if ax.axison]
    assert len(visible) == len(panels_with_data(_rows())) == 6

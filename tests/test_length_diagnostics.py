"""Per-length GSPO diagnostics: bucket names, histogram bins, clip fractions, exact reduction."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.algorithms.length_diagnostics import bucket_labels, length_diagnostics
from gspo_megatron.algorithms.metrics import accumulate_metrics, metrics_to_floats
from gspo_megatron.config.schema import DiagnosticsConfig


def test_bucket_labels():
    assert bucket_labels([2, 3, 8]) == ["le2", "3", "4to8", "gt8"]
    assert bucket_labels([256]) == ["le256", "gt256"]


def _example():
    # Four sequences of lengths 1, 2, 5, 9 (tokens listed per sequence, in order).
    counts = torch.tensor([1, 2, 5, 9])
    seq_index = torch.repeat_interleave(torch.arange(4), counts)
    log_ratio = torch.tensor([-2e-2, 5e-4, 0.0, -5e-4], dtype=torch.float64)
    token_clipped = torch.zeros(17, dtype=torch.bool)
    token_clipped[[1, 2, 8]] = True  # seq 1: both tokens; seq 3: one of nine
    seq_clipped = torch.tensor([False, True, False, True])
    return log_ratio, seq_clipped, token_clipped, counts, seq_index


def test_values_by_bucket_and_bin():
    cfg = DiagnosticsConfig(length_bucket_edges=[2, 5], log_ratio_bin_edges=[-1e-3, 0.0, 4e-4])
    m = metrics_to_floats(length_diagnostics(*_example(), cfg))
    # Buckets: le2 = {seq 0, seq 1}, 3to5 = {seq 2}, gt5 = {seq 3}.
    assert m["len_le2/seq_frac"] == 0.5 and m["len_3to5/seq_frac"] == 0.25
    assert m["len_le2/clip_frac_token"] == pytest.approx(2 / 3)
    assert m["len_le2/clip_frac_seq"] == 0.5 and m["len_3to5/clip_frac_seq"] == 0.0
    assert m["len_gt5/clip_frac_token"] == pytest.approx(1 / 9)
    # Bins: (-inf,-1e-3) [-1e-3,0) [0,4e-4) [4e-4,inf): seq 0 -> 0, seq 1 -> 3, 2 -> 2, 3 -> 1.
    assert (m["len_le2/log_ratio_hist0"], m["len_le2/log_ratio_hist3"]) == (0.5, 0.5)
    assert m["len_le2/log_ratio_hist1"] == 0.0 and m["len_3to5/log_ratio_hist2"] == 1.0
    assert m["len_gt5/log_ratio_hist1"] == 1.0
    assert m["len_le2/log_ratio_abs_mean"] == pytest.approx((2e-2 + 5e-4) / 2)
    assert m["seq_log_ratio_min"] == pytest.approx(-2e-2) and m["seq_log_ratio_max"] == 5e-4
    assert m["seq_log_ratio_abs_mean"] == pytest.approx((2e-2 + 5e-4 + 0.0 + 5e-4) / 4)


def test_split_batches_reduce_to_the_whole_and_empty_buckets_are_left_out():
    cfg = DiagnosticsConfig(length_bucket_edges=[2, 5, 100], log_ratio_bin_edges=[0.0])
    log_ratio, seq_clipped, token_clipped, counts, seq_index = _example()
    whole = metrics_to_floats(length_diagnostics(log_ratio, seq_clipped, token_clipped, counts,
                                                 seq_index, cfg))
    parts: dict = {}
    for seqs, toks in (([0, 1], slice(0, 3)), ([2, 3], slice(3, 17))):
        local_index = seq_index[toks] - seqs[0]
        accumulate_metrics(parts, length_diagnostics(log_ratio[seqs], seq_clipped[seqs],
                                                     token_clipped[toks], counts[seqs],
                                                     local_index, cfg))
    assert metrics_to_floats(parts) == pytest.approx(whole)
    assert "len_gt100/clip_frac_seq" not in whole and whole["len_gt100/seq_frac"] == 0.0

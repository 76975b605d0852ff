"""[sum, count] metrics: exact means over uneven micro-batches, max / min by name, floats.
(The multi-rank all-reduce is checked in tests/test_losses.py's CP=2 worker.)"""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.algorithms.metrics import (
    accumulate_metrics, all_reduce_metrics, metric_max, metric_mean, metric_min, metrics_to_floats,
    reduce_kind)


def test_mean_is_exact_over_uneven_micro_batches():
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0])
    totals = {}
    for part in (a, b):
        accumulate_metrics(totals, {"x": metric_mean(part), "x_max": metric_max(part),
                                    "x_min": metric_min(part)})
    out = metrics_to_floats(totals)
    assert out == {"x": pytest.approx(16 / 4), "x_max": 10.0, "x_min": 1.0}
    assert totals["x"].dtype == torch.float64


def test_mask_empty_metrics_and_kinds():
    assert metric_mean(torch.tensor([1.0, 5.0]), torch.tensor([False, True])).tolist() == [5.0, 1.0]
    empty = {"e": metric_mean(torch.zeros(0)), "e_max": metric_max(torch.zeros(0))}
    assert metrics_to_floats(empty) == {}
    assert math.isinf(empty["e_max"][0].item())
    assert [reduce_kind(n) for n in ("a_max", "a_min", "a")] == ["max", "min", "mean"]


def test_bad_metric_shape_is_refused_and_single_process_reduce_is_identity():
    with pytest.raises(ValueError, match="metric 'bad' must be a \\[sum, count\\] tensor"):
        accumulate_metrics({}, {"bad": torch.tensor(1.0)})
    m = {"x": metric_mean(torch.tensor([2.0]))}
    assert all_reduce_metrics(m) is m and m["x"].tolist() == [2.0, 1.0]

"""GSPO diagnostics by response length: sequence log-ratio histograms and clip fractions.

GSPO's length normalisation (paper Eq. 7, ``log s_i = mean_t(log pi - log pi_old)``) is meant to
keep the sequence ratio in one numerical range whatever the response length, so that one clip
range fits every sequence. These metrics show whether it does, per response-length bucket, for
every loss (the sequence log-ratio is the same quantity under GRPO; only its clipping is per
token). All are exactly reducible ``[sum, count]`` metrics (``algorithms/metrics.py``); bucket
``b`` of ``cfg.length_bucket_edges = [e_0, e_1, ...]`` is named ``le<e_0>``, ``<e_0+1>to<e_1>``,
..., ``gt<e_last>``:

    len_<b>/seq_frac             fraction of the mini-batch's sequences in bucket b
    len_<b>/clip_frac_token      clipped tokens among the bucket's response tokens
    len_<b>/clip_frac_seq        sequences with a clipped token among the bucket's sequences
    len_<b>/log_ratio_abs_mean   mean |log s_i| over the bucket's sequences
    len_<b>/log_ratio_hist<j>    fraction of the bucket's sequences whose log s_i is in bin j
    seq_log_ratio_abs_mean, seq_log_ratio_min, seq_log_ratio_max   over every sequence

Histogram bin ``j`` of ``cfg.log_ratio_bin_edges = [b_0, ..., b_m]`` is ``[b_(j-1), b_j)``, with
bin 0 ``(-inf, b_0)`` and bin ``m + 1`` ``[b_m, inf)``. Under context parallelism every CP rank
counts each of its sequences once (the same on every rank, so means are unchanged) and its own
tokens.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from gspo_megatron.algorithms.metrics import metric_max, metric_mean, metric_min

Metrics = Dict[str, torch.Tensor]


def bucket_labels(edges: Sequence[int]) -> List[str]:
    """``[2, 3, 8]`` -> ``['le2', '3', '4to8', 'gt8']``."""
    labels = [f"le{edges[0]}"]
    for low, high in zip(edges[:-1], edges[1:]):
        labels.append(str(high) if high == low + 1 else f"{low + 1}to{high}")
    return labels + [f"gt{edges[-1]}"]


def length_diagnostics(seq_log_ratio: torch.Tensor, seq_clipped: torch.Tensor,
                       token_clipped: torch.Tensor, seq_token_counts: torch.Tensor,
                       seq_index: torch.Tensor, cfg) -> Metrics:
    """Per-length-bucket metrics (see module docstring).

    ``seq_log_ratio`` float ``[num_seqs]``; ``seq_clipped`` bool ``[num_seqs]``;
    ``token_clipped`` bool ``[N]`` with ``seq_index`` int64 ``[N]``; ``seq_token_counts`` int64
    ``[num_seqs]`` full response lengths; ``cfg``: ``config.schema.DiagnosticsConfig``."""
    log_ratio = seq_log_ratio.detach().double()
    edges = torch.as_tensor(list(cfg.length_bucket_edges), dtype=torch.int64,
                            device=seq_token_counts.device)
    seq_bucket = torch.bucketize(seq_token_counts, edges)  # e_(b-1) < length <= e_b
    tok_bucket = seq_bucket[seq_index]
    bins = torch.as_tensor(list(cfg.log_ratio_bin_edges), dtype=torch.float64,
                           device=log_ratio.device)
    seq_bin = torch.bucketize(log_ratio, bins, right=True)  # b_(j-1) <= x < b_j
    out: Metrics = {"seq_log_ratio_abs_mean": metric_mean(log_ratio.abs()),
                    "seq_log_ratio_min": metric_min(log_ratio),
                    "seq_log_ratio_max": metric_max(log_ratio)}
    for b, label in enumerate(bucket_labels(list(cfg.length_bucket_edges))):
        in_bucket = seq_bucket == b
        prefix = f"len_{label}/"
        out[prefix + "seq_frac"] = metric_mean(in_bucket.double())
        out[prefix + "clip_frac_token"] = metric_mean(token_clipped.double(), tok_bucket == b)
        out[prefix + "clip_frac_seq"] = metric_mean(seq_clipped.double(), in_bucket)
        out[prefix + "log_ratio_abs_mean"] = metric_mean(log_ratio.abs(), in_bucket)
        for j in range(bins.numel() + 1):
            out[f"{prefix}log_ratio_hist{j}"] = metric_mean((seq_bin == j).double(), in_bucket)
    return out

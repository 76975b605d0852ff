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

from gspo_megatron.algorithms.metrics import metric_max, metric_mean, metric_min, metric_rows

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
    abs_log_ratio = log_ratio.abs()
    labels = bucket_labels(list(cfg.length_bucket_edges))
    edges = torch.as_tensor(list(cfg.length_bucket_edges), dtype=torch.int64,
                            device=seq_token_counts.device)
    seq_bucket = torch.bucketize(seq_token_counts, edges)  # e_(b-1) < length <= e_b
    tok_bucket = seq_bucket[seq_index]
    bins = torch.as_tensor(list(cfg.log_ratio_bin_edges), dtype=torch.float64,
                           device=log_ratio.device)
    seq_bin = torch.bucketize(log_ratio, bins, right=True)  # b_(j-1) <= x < b_j
    num_buckets, num_bins = len(labels), bins.numel() + 1
    # One matmul per level instead of ~40 masked means (the loss runs this every micro-batch):
    # per bucket, the sums of [1, clipped, |log s|] over its sequences, of [1, clipped] over its
    # tokens, and the count of its sequences in each histogram bin. Sums of 0/1 are exact.
    seq_in = torch.nn.functional.one_hot(seq_bucket, num_buckets).double().T  # [B, S]
    tok_in = torch.nn.functional.one_hot(tok_bucket, num_buckets).double().T  # [B, N]
    per_seq = seq_in @ torch.stack([torch.ones_like(log_ratio), seq_clipped.double(),
                                    abs_log_ratio], dim=1)  # [B, 3]
    per_tok = tok_in @ torch.stack([torch.ones_like(token_clipped, dtype=torch.float64),
                                    token_clipped.double()], dim=1)  # [B, 2]
    hist = seq_in @ torch.nn.functional.one_hot(seq_bin, num_bins).double()  # [B, bins]
    seqs, toks = per_seq[:, 0], per_tok[:, 0]
    sums = torch.cat([per_seq[:, 0:1], per_tok[:, 1:2], per_seq[:, 1:3], hist], dim=1)
    counts = torch.cat([torch.full_like(seqs, float(log_ratio.numel())).unsqueeze(1),
                        toks.unsqueeze(1), seqs.unsqueeze(1).expand(-1, 2 + num_bins)], dim=1)
    names = [f"len_{label}/{name}" for label in labels
             for name in ("seq_frac", "clip_frac_token", "clip_frac_seq", "log_ratio_abs_mean",
                          *(f"log_ratio_hist{j}" for j in range(num_bins)))]
    out: Metrics = {"seq_log_ratio_abs_mean": metric_mean(abs_log_ratio),
                    "seq_log_ratio_min": metric_min(log_ratio),
                    "seq_log_ratio_max": metric_max(log_ratio)}
    out.update(metric_rows(names, sums.reshape(-1), counts.reshape(-1)))
    return out

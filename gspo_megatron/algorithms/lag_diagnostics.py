"""Clip fractions by policy lag: how much of the update stale tokens lose to clipping.

With asynchronous rollouts (``rollout.max_staleness``) a token may come from a weight version
several updates behind the learner (``PolicyLossInputs.token_lag``). Its ratio to the proximal
policy is not affected by that lag (the proximal policy is recomputed), but its behaviour weight
is, and a clip fraction that grows with the lag would show the trust region biting on old data.
Every loss reports, when ``token_lag`` is given:

    clip_frac_token_lag<b>   clipped tokens among the tokens of lag bucket b
    clip_frac_seq_lag<b>     sequences with a clipped token among the sequences whose *oldest*
                             token (largest lag) falls in bucket b

for the fixed buckets ``lag0``, ``lag1``, ``lag2``, ``lag3``, ``lag4plus``, so every rank holds
the same metric names whatever lags its micro-batches hold. Each is an exactly reducible
``[sum, count]`` row (``algorithms/metrics.py``); a bucket no token fell into is ``[0, 0]`` and
``metrics_to_floats`` leaves it out, so an empty bucket is absent from the logged step rather
than a 0. Under context parallelism a sequence's largest lag is taken over the CP group, and
every CP rank counts each sequence once (the same on every rank, so the means are unchanged) and
its own tokens.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from gspo_megatron.algorithms.metrics import metric_rows

Metrics = Dict[str, torch.Tensor]

LAG_BUCKETS: Tuple[str, ...] = ("lag0", "lag1", "lag2", "lag3", "lag4plus")
"""Bucket ``b`` holds lag ``b``; the last one every lag of ``len(LAG_BUCKETS) - 1`` or more."""


def lag_bucket(lag: torch.Tensor) -> torch.Tensor:
    """int64 bucket index into :data:`LAG_BUCKETS` of every lag (``lag >= 0``)."""
    return lag.long().clamp(max=len(LAG_BUCKETS) - 1)


def sequence_max_lag(token_lag: torch.Tensor, seq_index: torch.Tensor, num_seqs: int,
                     cp_group=None) -> torch.Tensor:
    """int64 ``[num_seqs]``: the largest lag of each sequence, over the CP group when given
    (-1 for a sequence with no token anywhere, which the loss contract rules out)."""
    out = torch.full((num_seqs,), -1, dtype=torch.int64, device=token_lag.device)
    out = out.scatter_reduce(0, seq_index, token_lag.long(), reduce="amax", include_self=True)
    if cp_group is not None and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size(cp_group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=cp_group)
    return out


def lag_clip_metrics(token_clipped: torch.Tensor, seq_clipped: torch.Tensor,
                     token_lag: torch.Tensor, seq_index: torch.Tensor,
                     cp_group: Optional[object] = None) -> Metrics:
    """``clip_frac_token_lag<b>`` and ``clip_frac_seq_lag<b>`` (see module docstring).

    ``token_clipped`` bool ``[N]``; ``seq_clipped`` bool ``[num_seqs]`` (complete over CP);
    ``token_lag`` int64 ``[N]``; ``seq_index`` int64 ``[N]``."""
    num_buckets = len(LAG_BUCKETS)
    seq_lag = sequence_max_lag(token_lag, seq_index, seq_clipped.numel(), cp_group)
    # One matmul per level: per bucket, [count, clipped count] of its tokens / sequences.
    tok_in = torch.nn.functional.one_hot(lag_bucket(token_lag), num_buckets).double().T
    seq_in = torch.nn.functional.one_hot(lag_bucket(seq_lag.clamp(min=0)), num_buckets).double().T
    per_tok = tok_in @ torch.stack([torch.ones_like(token_clipped, dtype=torch.float64),
                                    token_clipped.double()], dim=1)  # [B, 2]
    per_seq = seq_in @ torch.stack([torch.ones_like(seq_clipped, dtype=torch.float64),
                                    seq_clipped.double()], dim=1)  # [B, 2]
    names = [f"clip_frac_token_{b}" for b in LAG_BUCKETS] + \
            [f"clip_frac_seq_{b}" for b in LAG_BUCKETS]
    sums = torch.cat([per_tok[:, 1], per_seq[:, 1]])
    counts = torch.cat([per_tok[:, 0], per_seq[:, 0]])
    return metric_rows(names, sums, counts)

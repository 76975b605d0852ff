"""The contract between the learner and the policy losses.

The learner computes, for one packed micro-batch, the log-probs of every *response* token in a
flat 1-D layout (prompt tokens and padding removed), tags each token with the index of the
sequence it belongs to, and calls a registered loss with :class:`PolicyLossInputs`. The loss
returns a scalar whose gradient, summed over all micro-batches and data-parallel ranks, is the
gradient of the objective over the whole mini-batch: it already divides by the mini-batch's
global sequence count (GSPO, GSPO-token, GRPO ``seq_mean_token_mean``) or token count
(GRPO ``token_mean``), which the learner supplies.

Under context parallelism a rank sees only part of each sequence; ``seq_token_counts`` then
holds the *full* response length of each sequence, and ``cp_group`` is the group over which
per-sequence sums are completed, so sequence ratios are exact. Every CP rank passes the same
``num_seqs`` (a sequence may have no tokens on a rank). The loss value on each CP rank is that
rank's share of the objective and its gradient is exact for the rank's own tokens, so parameter
gradients are *summed* over the CP ranks too (as over micro-batches and DP ranks), and
``global_num_seqs`` / ``global_num_tokens`` count each sequence / token once, not once per CP rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch


@dataclass
class PolicyLossInputs:
    """One micro-batch of response tokens. All per-token tensors are [num_tokens]."""

    logprobs: torch.Tensor
    """Current-policy log-probs of the sampled tokens (requires grad)."""
    old_logprobs: torch.Tensor
    """Log-probs under pi_old, the centre of the clip range: the learner's recomputation under
    its weights before this update (the proximal policy; ``old_logprob_source=learner``), or the
    engine's (``rollout``). With stale rollouts only the former is a single policy
    (``docs/algorithms.md``, "Stale rollouts")."""
    advantages: torch.Tensor
    """Per-token advantages; constant within a sequence for sequence-level advantages."""
    seq_index: torch.Tensor
    """int64 index in [0, num_seqs) of the sequence each token belongs to."""
    num_seqs: int
    """Sequences in this micro-batch (on this rank)."""
    seq_token_counts: torch.Tensor
    """[num_seqs] full response length of each sequence (all CP ranks together)."""
    global_num_seqs: int
    """Sequences in the whole mini-batch, all micro-batches and DP ranks: the loss normaliser."""
    global_num_tokens: int
    """Response tokens in the whole mini-batch: the normaliser of token-mean losses."""
    entropy: Optional[torch.Tensor] = None
    """Per-token entropy of the current policy (needed when ``entropy_coef > 0``)."""
    ref_logprobs: Optional[torch.Tensor] = None
    """Reference-policy log-probs (needed when ``kl_coef > 0``)."""
    rollout_logprobs: Optional[torch.Tensor] = None
    """The behaviour log-probs: the engine's log-prob of each token as it was sampled (for a
    rollout continued across weight updates, each token's own version's, concatenated). Used by
    the truncated IS / behaviour weight (``algo.tis``) and the mismatch metrics."""
    cp_group: Optional[object] = None
    """Context-parallel process group; None when sequences are whole on this rank."""
    token_lag: Optional[torch.Tensor] = None
    """int64, >= 0: the learner's version at this update minus the weight version that
    generated each token (0: on-policy). Metrics only: the clip fraction by lag."""


@dataclass
class LossOutput:
    """A scalar loss (already normalised, see module docstring) and detached metrics.

    Each metric value is a float64 tensor ``[sum, count]`` over this micro-batch, so that the
    learner can reduce it exactly across micro-batches and ranks (mean = total sum / total
    count). Names ending in ``_max`` or ``_min`` hold ``[value, 1]`` and reduce by max / min.
    ``algorithms/metrics.py`` has the reduction helpers.
    """

    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor] = field(default_factory=dict)

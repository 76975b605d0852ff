"""Temperature / top-p sampling with per-sample generators, and the log-probs it reports.

Pure tensor functions used by the embedded engine. Each row of a batch draws its token from
its own ``torch.Generator`` (seeded per (prompt_id, sample_index)), by inverting the CDF of the
processed distribution with one uniform number, so a sample does not depend on which other
samples share its batch.

Log-probs (see docs/rollout.md):
- ``scaled`` (default, SGLang's semantics): ``log_softmax(logits / T)[y]`` — temperature
  applied, top-p truncation not. This is what the learner recomputes from its own logits.
- ``sampled``: the log-prob under the truncated, renormalised distribution actually sampled
  from. Equal to ``scaled`` when ``top_p == 1``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

LOGPROB_MODES = ("scaled", "sampled")


def top_p_mask(scaled_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean [B, V] mask of the tokens kept by nucleus sampling (the top token always is).

    Keeps the smallest prefix of tokens, by descending probability, whose mass reaches top_p.
    """
    if top_p >= 1.0:
        return torch.ones_like(scaled_logits, dtype=torch.bool)
    probs = torch.softmax(scaled_logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted)
    keep.scatter_(-1, order, keep_sorted)
    return keep


def process_logits(logits: torch.Tensor, temperature: float, top_p: float
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(scaled, sampling)`` log-prob tensors [B, V] for raw logits [B, V] (float32)."""
    scaled = logits.float() / temperature
    keep = top_p_mask(scaled, top_p)
    truncated = scaled.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(scaled, dim=-1), torch.log_softmax(truncated, dim=-1)


def draw_tokens(sampling_logprobs: torch.Tensor,
                generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
    """One token per row of [B, V] log-probs, row i using ``generators[i]`` -> int64 [B]."""
    probs = sampling_logprobs.exp()
    cdf = torch.cumsum(probs, dim=-1)
    uniforms = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    targets = (uniforms.to(cdf.device, cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf.contiguous(), targets, right=True).squeeze(-1)
    tokens = tokens.clamp_(max=probs.shape[-1] - 1)
    # searchsorted can land on a zero-probability token only through float ties at the end of
    # the CDF; step back to the last token with mass.
    bad = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) <= 0
    if bool(bad.any()):
        last_kept = (probs > 0).long().cumsum(-1).argmax(-1)
        tokens = torch.where(bad, last_kept, tokens)
    return tokens


def make_generators(seeds: Sequence[Optional[int]]) -> List[torch.Generator]:
    """CPU generators, seeded when a seed is given, else from fresh entropy."""
    gens = []
    for seed in seeds:
        g = torch.Generator(device="cpu")
        if seed is None:
            g.seed()
        else:
            g.manual_seed(int(seed))
        gens.append(g)
    return gens


def select_logprobs(scaled: torch.Tensor, sampling: torch.Tensor, tokens: torch.Tensor,
                    mode: str) -> torch.Tensor:
    """Log-probs [B] of ``tokens`` [B] under the chosen semantics."""
    if mode not in LOGPROB_MODES:
        raise ValueError(f"logprob_mode must be one of {LOGPROB_MODES}, got {mode!r}")
    source = scaled if mode == "scaled" else sampling
    return source.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

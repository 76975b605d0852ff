"""Tests of temperature / top-p sampling and log-prob semantics (rollout/embedded/sampling.py)."""

import pytest
import torch

from gspo_megatron.rollout.embedded.sampling import (draw_tokens, make_generators, process_logits,
                                            select_logprobs, top_p_mask)


def test_top_p_mask_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert top_p_mask(logits, 0.5).tolist() == [[True, False, False, False]]
    assert top_p_mask(logits, 0.75).tolist() == [[True, True, False, False]]
    assert top_p_mask(logits, 0.81).tolist() == [[True, True, True, False]]
    assert top_p_mask(logits, 1.0).all()
    assert top_p_mask(logits, 1e-6).tolist() == [[True, False, False, False]]


def test_process_logits_semantics():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    scaled, sampling = process_logits(logits, temperature=0.5, top_p=0.9)
    assert torch.allclose(scaled, torch.log_softmax(logits / 0.5, -1))
    kept = top_p_mask(logits / 0.5, 0.9)
    assert torch.isinf(sampling[~kept]).all()
    assert torch.allclose(sampling[kept].exp().sum(), torch.tensor(1.0))
    tokens = torch.tensor([0])
    assert select_logprobs(scaled, sampling, tokens, "scaled") < select_logprobs(scaled, sampling, tokens, "sampled")
    with pytest.raises(ValueError, match="logprob_mode"):
        select_logprobs(scaled, sampling, tokens, "raw")


def test_draw_tokens_is_reproducible_per_row_and_matches_distribution():
    probs = torch.tensor([0.1, 0.6, 0.3, 0.0])
    logp = torch.log(probs).expand(4000, 4)
    tokens = draw_tokens(logp, make_generators(range(4000)))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    assert freq[3] == 0  # zero-probability token never drawn
    # row i depends only on its own generator
    again = draw_tokens(logp[:3], make_generators([0, 1, 2]))
    assert again.tolist() == tokens[:3].tolist()

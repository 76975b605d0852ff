"""The lean Qwen3 / Qwen3-MoE decoder against the model's own Hugging Face forward."""

import pytest
import torch

from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.embedded.kv_decoder import (HFDecoder, Qwen3Decoder, lean_path_unsupported,
                                              make_decoder)
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def moe_policy():
    torch.set_num_threads(1)
    return build_tiny_policy(seed=0)


def _dense_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=64, attention_bias=True, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).eval()


def _left_padded(rows, pad=0):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def _run(decoder, ids, mask, steps, alive_schedule):
    out = [decoder.prefill(ids, mask, steps)]
    g = torch.Generator().manual_seed(0)
    for t in range(steps):
        tokens = torch.randint(1, 20, (ids.shape[0],), generator=g)
        out.append(decoder.step(tokens, alive_schedule[t]))
    return out


@pytest.mark.parametrize("which", ["moe", "dense"])
def test_lean_decoder_matches_hf_forward(moe_policy, which):
    model = moe_policy[0] if which == "moe" else _dense_qwen3()
    assert lean_path_unsupported(model) is None
    ids, mask = _left_padded([[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]])
    steps = 6
    # row 1 finishes after step 2: its later inputs are padding the cache must ignore
    alive = [torch.tensor([True, t < 2, True]) for t in range(steps)]
    lean = _run(Qwen3Decoder(model), ids, mask, steps, alive)
    ref = _run(HFDecoder(model), ids, mask, steps, alive)
    for t, (a, b) in enumerate(zip(lean, ref)):
        live = torch.ones(3, dtype=torch.bool) if t == 0 else alive[t - 1]
        assert torch.allclose(a[live], b[live], atol=1e-5), f"step {t}: {(a - b).abs().max()}"
        assert torch.isfinite(a).all()


def test_lean_decoder_sees_weight_loads(moe_policy):
    """It reads the HF parameters themselves: an in-place load changes its output."""
    model, _ = moe_policy
    ids, mask = _left_padded([[3, 4, 5]])
    decoder = make_decoder(model)
    assert isinstance(decoder, Qwen3Decoder)
    before = decoder.prefill(ids, mask, 1)
    weight = model.lm_head.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(2.0)
    try:
        after = make_decoder(model).prefill(ids, mask, 1)
        assert torch.allclose(after, before * 2.0, atol=1e-5)
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_unsupported_model_falls_back_to_hf():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30)).eval()
    assert "gpt2" in lean_path_unsupported(model)
    assert isinstance(make_decoder(model), HFDecoder)
    with pytest.raises(ValueError, match="gpt2"):
        Qwen3Decoder(model)


def test_step_beyond_prefill_budget_is_an_error(moe_policy):
    ids, mask = _left_padded([[3, 4]])
    decoder = Qwen3Decoder(moe_policy[0])
    decoder.prefill(ids, mask, 1)
    decoder.step(torch.tensor([5]), torch.tensor([True]))
    with pytest.raises(RuntimeError, match="max_new_tokens"):
        decoder.step(torch.tensor([5]), torch.tensor([True]))


def test_engine_samples_identical_on_both_paths(moe_policy):
    model, tok = moe_policy
    texts = ["what is 1+1?", "2+2=", "say hi"]
    requests = [GenerationRequest(f"p{i}", tok(t)["input_ids"], n=4) for i, t in enumerate(texts)]
    params = SamplingParams(temperature=0.9, max_new_tokens=12, seed=5)
    lean = EmbeddedEngine(model, tok).generate(requests, params)
    hf = EmbeddedEngine(model, tok, lean_decode=False).generate(requests, params)
    assert [s.response_token_ids for s in lean] == [s.response_token_ids for s in hf]
    assert [s.finish_reason for s in lean] == [s.finish_reason for s in hf]
    for a, b in zip(lean, hf):
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-5)

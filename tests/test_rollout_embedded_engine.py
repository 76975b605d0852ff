"""Tests of the embedded (in-process transformers) rollout engine."""

import pytest
import torch

from gspo_megatron.rollout.embedded.engine import EmbeddedEngine, teacher_forced_logprobs
from gspo_megatron.tiny_task.model import build_tiny_policy, save_tiny_model
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams
from gspo_megatron.weight_sync.in_process import InProcessTransport


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    return build_tiny_policy(seed=0)


def _requests(tok, num_prompts=3, n=2):
    texts = ["what is 1+1?", "2+2=", "say hi"][:num_prompts]
    return [GenerationRequest(f"p{i}", tok(t)["input_ids"], n=n) for i, t in enumerate(texts)]


def test_same_seed_same_samples_whatever_the_batching(policy):
    model, tok = policy
    params = SamplingParams(temperature=0.9, max_new_tokens=10, seed=11)
    big = EmbeddedEngine(model, tok, max_batch_size=64).generate(_requests(tok), params)
    small = EmbeddedEngine(model, tok, max_batch_size=2).generate(_requests(tok), params)
    assert [s.response_token_ids for s in big] == [s.response_token_ids for s in small]
    for a, b in zip(big, small):
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-5)
    other = EmbeddedEngine(model, tok).generate(_requests(tok), SamplingParams(
        temperature=0.9, max_new_tokens=10, seed=12))
    assert [s.response_token_ids for s in other] != [s.response_token_ids for s in big]


def test_logprobs_equal_teacher_forced_forward(policy):
    model, tok = policy
    params = SamplingParams(temperature=0.7, max_new_tokens=12, seed=3)
    samples = EmbeddedEngine(model, tok).generate(_requests(tok), params)
    assert [s.key for s in samples] == sorted(s.key for s in samples)
    for s in samples:
        assert len(s.response_logprobs) == len(s.response_token_ids) > 0
        ref = teacher_forced_logprobs(model, s.prompt_token_ids, s.response_token_ids, 0.7)
        assert torch.allclose(torch.tensor(s.response_logprobs), ref, atol=1e-5)


def test_sampled_logprob_mode_uses_truncated_distribution(policy):
    model, tok = policy
    params = SamplingParams(temperature=1.0, top_p=0.5, max_new_tokens=8, seed=3)
    scaled = EmbeddedEngine(model, tok).generate(_requests(tok, 1, 2), params)
    sampled = EmbeddedEngine(model, tok, logprob_mode="sampled").generate(_requests(tok, 1, 2), params)
    for a, b in zip(scaled, sampled):
        assert a.response_token_ids == b.response_token_ids
        # renormalising over the nucleus raises every log-prob (or keeps it when nothing is cut)
        assert all(y >= x - 1e-6 for x, y in zip(a.response_logprobs, b.response_logprobs))
    assert any(y > x + 1e-3 for a, b in zip(scaled, sampled)
               for x, y in zip(a.response_logprobs, b.response_logprobs))


def test_finish_reasons(policy):
    model, tok = policy
    eng = EmbeddedEngine(model, tok)
    req = _requests(tok, 1, 4)
    full = eng.generate(req, SamplingParams(max_new_tokens=6, seed=5))
    assert all(len(s.response_token_ids) <= 6 for s in full)
    assert all(s.finish_reason == "length" for s in full if len(s.response_token_ids) == 6
               and s.response_token_ids[-1] != tok.eos_token_id)
    first = full[0].response_token_ids[0]
    by_id = eng.generate(req, SamplingParams(max_new_tokens=6, seed=5, stop_token_ids=[first]))
    assert by_id[0].response_token_ids == [first] and by_id[0].finish_reason == "stop"
    stop_text = tok.decode(full[0].response_token_ids[:2])
    by_str = eng.generate(req, SamplingParams(max_new_tokens=6, seed=5, stop=[stop_text]))
    assert by_str[0].finish_reason == "stop"
    assert stop_text in tok.decode(by_str[0].response_token_ids)
    assert len(by_str[0].response_token_ids) <= 2


def test_load_weights_switches_the_policy(policy):
    model, tok = policy
    fresh, _ = build_tiny_policy(seed=0)
    new, _ = build_tiny_policy(seed=9)
    eng = EmbeddedEngine(fresh, tok)
    with pytest.raises(RuntimeError, match="no weight transport"):
        eng.update_weights(new.state_dict().items(), weight_version="v2")
    eng.attach_weight_transport(InProcessTransport(eng, 1 << 20))
    stats = eng.update_weights(new.state_dict().items(), weight_version="v2")
    assert stats.num_tensors == len(new.state_dict()) and stats.num_bytes > 0
    s = eng.generate(_requests(tok, 1, 1), SamplingParams(max_new_tokens=8, seed=2))[0]
    assert s.weight_version == "v2"
    ref = teacher_forced_logprobs(new, s.prompt_token_ids, s.response_token_ids)
    assert torch.allclose(torch.tensor(s.response_logprobs), ref, atol=1e-5)
    old = teacher_forced_logprobs(model, s.prompt_token_ids, s.response_token_ids)
    assert not torch.allclose(torch.tensor(s.response_logprobs), old, atol=1e-3)


def test_load_weights_rejects_unknown_names_and_shapes(policy):
    model, tok = policy
    eng = EmbeddedEngine(build_tiny_policy()[0], tok)
    with pytest.raises(KeyError, match="model.layers.9"):
        eng.load_weights([("model.layers.9.foo.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="lm_head.weight"):
        eng.load_weights([("lm_head.weight", torch.zeros(3, 3))])


def test_from_pretrained_and_disk_load(tmp_path, policy):
    model, tok = policy
    save_tiny_model(*build_tiny_policy(seed=0), tmp_path / "m")
    eng = EmbeddedEngine.from_pretrained(str(tmp_path / "m"))
    assert eng.health()
    new, _ = build_tiny_policy(seed=4)
    new.save_pretrained(str(tmp_path / "new"))
    stats = eng.load_weights_from_disk(str(tmp_path / "new"))
    assert stats.num_tensors == len(new.state_dict())
    for name, t in new.state_dict().items():
        assert torch.equal(eng.model.state_dict()[name], t), name
    with pytest.raises(FileNotFoundError, match="safetensors"):
        eng.load_weights_from_disk(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        EmbeddedEngine.from_pretrained(str(tmp_path / "missing"))


def test_should_stop_aborts_rows(policy):
    model, tok = policy
    eng = EmbeddedEngine(model, tok)
    calls = []

    def should_stop():
        calls.append(1)
        return [True, False]  # row 0 is cancelled before its first step

    rows = eng.generate_token_ids([tok("1+1=")["input_ids"]] * 2, [1, 2],
                                  SamplingParams(max_new_tokens=6), should_stop=should_stop)
    assert rows[0].finish_reason == "abort" and rows[0].tokens == []
    assert rows[1].finish_reason in ("stop", "length") and len(rows[1].tokens) >= 1
    assert len(calls) == len(rows[1].tokens)


def _hf_routing(model, ids) -> torch.Tensor:
    """Top-k experts of every layer for every position of ``ids`` through the HF forward."""
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: logits.append(out))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    top_k = model.config.num_experts_per_tok
    return torch.stack([torch.topk(x.float(), top_k, dim=-1).indices for x in logits], 1)


def test_recorded_routing_is_the_models_own_for_every_fed_position(policy):
    """R3: positions 0 .. P + R - 2 (the last token is never fed back), as SGLang returns them,
    for responses that stop, run out of length or are cut; recording changes no sample."""
    model, tok = policy
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    plain = EmbeddedEngine(model, tok).generate(_requests(tok, n=3), params)
    recorded = EmbeddedEngine(model, tok, record_routing=True).generate(_requests(tok, n=3), params)
    assert [s.response_token_ids for s in recorded] == [s.response_token_ids for s in plain]
    assert plain[0].routed_experts is None
    assert {s.finish_reason for s in recorded} == {"stop", "length"}
    for s in recorded:
        ids = s.prompt_token_ids + s.response_token_ids
        assert s.routed_experts.dtype == torch.int16
        assert s.routed_experts.shape == (len(ids) - 1, model.config.num_hidden_layers, 2)
        assert torch.equal(s.routed_experts.long(), _hf_routing(model, ids[:-1])), s.key
    eng = EmbeddedEngine(model, tok, record_routing=True)
    cut = iter([[False, False], [False, False], [True, False]] + [[True, False]] * 8)
    rows = eng.generate_token_ids([tok("1+1=")["input_ids"]] * 2, [2, 3],  # 6 tokens unless cut
                                  SamplingParams(max_new_tokens=6), should_stop=lambda: next(cut))
    assert rows[0].finish_reason == "abort" and len(rows[0].tokens) == 2
    ids = tok("1+1=")["input_ids"] + rows[0].tokens
    assert torch.equal(rows[0].routing.long(), _hf_routing(model, ids[:-1]))


def test_recording_routing_needs_the_lean_moe_decoder(policy):
    model, tok = policy
    with pytest.raises(ValueError, match="lean Qwen3-MoE decoder: lean_decode is off"):
        EmbeddedEngine(model, tok, lean_decode=False, record_routing=True)

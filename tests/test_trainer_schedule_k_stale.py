"""trainer/schedule/k_stale.py's ledger records of a group: the engine's versions and servers.

The schedule itself runs in tests/test_trainer_loop.py (two ranks, k = 2) and against the real
server in tests/test_trainer_schedule_k_stale_real_sglang.py; its generator has its own file."""

from gspo_megatron.rollout.types import Sample
from gspo_megatron.trainer.schedule.k_stale import engine_servers, engine_versions


def sample(idx, tokens, served_by=None, resent=(), versions=None):
    return Sample(prompt_id="p", sample_index=idx, prompt_token_ids=[1], response_token_ids=[7] * tokens,
                  response_logprobs=[-0.1] * tokens, finish_reason="stop", latency_s=0.1,
                  served_by=served_by, resent=list(resent), token_versions=versions)


def test_a_groups_tokens_are_counted_per_server_and_its_resends_kept_with_their_reasons():
    group = [sample(0, 5, {"a:1": 5}),
             sample(1, 6, {"b:1": 2, "a:1": 4}, resent=["b:1/generate: ConnectionError " + "x" * 300]),
             sample(2, 3, {"a:1": 3}, resent=["a:1: request p/2/0 aborted"])]
    tokens, reasons = engine_servers(group)
    assert tokens == {"a:1": 12, "b:1": 2}
    assert len(reasons) == 2 and reasons[0].startswith("b:1/generate") and len(reasons[0]) == 200
    assert reasons[1] == "a:1: request p/2/0 aborted"
    assert engine_servers([sample(0, 4)]) is None  # the embedded engine has no servers


def test_versions_are_counted_per_token_as_the_engine_reported_them():
    assert engine_versions([sample(0, 3, versions=[4, 4, 5]), sample(1, 2, versions=[5, 5])]) == {"4": 2, "5": 3}

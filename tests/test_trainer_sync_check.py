"""The post-sync probe (trainer/sync_check.py): every server's log-probs of its own probe sample
against the learner's recomputation of the same tokens, in one process.

The learner here is a stand-in that scores sequences with a fixed HF model, so that the test can
give one server other weights; the real Megatron learner against the real SGLang server runs in
tests/test_trainer_loop_real_sglang.py with rollout.weight_sync.verify=true.
"""

import pytest
import torch

from gspo_megatron.learner.learner import LogprobOutput
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine, teacher_forced_logprobs
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.rollout.standin.server import ReferenceServer
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.trainer.sync_check import SyncCheck, WeightsDidNotArrive


class HFLearner:
    """``compute_logprobs`` of a fixed HF model (the real one is a Megatron pass)."""

    def __init__(self, model):
        self.model = model
        self.batches = []

    def compute_logprobs(self, batch, temperature=None):
        self.batches.append(batch)
        with torch.no_grad():
            return LogprobOutput(
                logprobs=[teacher_forced_logprobs(self.model, ids[:p], ids[p:], temperature)
                          for ids, p in zip(batch.token_ids, batch.prompt_lens)],
                entropy=[])


@pytest.fixture
def servers():
    torch.set_num_threads(1)
    same = ReferenceServer(EmbeddedEngine(*build_tiny_policy(seed=0))).start()
    other = ReferenceServer(EmbeddedEngine(*build_tiny_policy(seed=1))).start()
    yield same, other
    same.stop()
    other.stop()


def test_a_server_with_other_weights_stops_the_run_naming_it(servers):
    same, other = servers
    model, tok = build_tiny_policy(seed=0)
    prompt = tok("12+7=")["input_ids"]
    learner = HFLearner(model)
    check = SyncCheck(learner, SGLangEngine([same.address], request_timeout_s=30), prompt,
                      temperature=0.7, tolerance=1e-4, is_main=True)
    metrics = check("5")
    assert metrics["weight_sync/probe_abs_logp"] < 1e-5
    batch = learner.batches[-1]
    assert batch.prompt_lens == [len(prompt)] and batch.token_ids[0][:len(prompt)] == list(prompt)
    both = SyncCheck(learner, SGLangEngine([same.address, other.address], request_timeout_s=30),
                     prompt, temperature=0.7, tolerance=1e-4, is_main=True)
    with pytest.raises(WeightsDidNotArrive, match=rf"version 6, rollout server {other.address}"):
        both("6")
    assert len(learner.batches[-1].token_ids) == 2  # one probe sequence per server


def test_fewer_live_servers_than_data_parallel_ranks_still_give_every_rank_a_share(servers):
    """A server died (or the fleet is small): two probes for three data-parallel ranks. The
    learner's pass refuses a batch smaller than its DP size (learner/batch.py, plan_step), so
    the probes are repeated to a multiple of it; each server is judged on its own probe."""
    same, other = servers
    model, tok = build_tiny_policy(seed=0)
    prompt = tok("12+7=")["input_ids"]
    learner = HFLearner(model)
    learner.dp_size = 3
    check = SyncCheck(learner, SGLangEngine([same.address, other.address], request_timeout_s=30), prompt,
                      temperature=0.7, tolerance=1e-4, is_main=True)
    with pytest.raises(WeightsDidNotArrive, match=rf"rollout server {other.address}"):
        check("7")
    rows = learner.batches[-1].token_ids
    assert len(rows) == 3 and rows[2] == rows[0]  # padded by repeating, multiple of the DP size
    learner.dp_size = 2
    alone = SyncCheck(learner, SGLangEngine([same.address], request_timeout_s=30), prompt,
                      temperature=0.7, tolerance=1e-4, is_main=True)
    assert alone("8")["weight_sync/probe_abs_logp"] < 1e-5
    assert len(learner.batches[-1].token_ids) == 2

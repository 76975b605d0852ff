"""A closed learner is freed with everything it holds: its DDP chunks, its optimizer and the gloo
groups they keep (their listening sockets). Without ``close`` Megatron's cycles through C++ keep
all of it, which the first case shows, so the check can fail."""

from __future__ import annotations

import pytest

from tests.descriptors import listening_sockets
from tests.multiproc import run_on_ranks
from tests.test_learner_learner import _gspo, make_batch, tiny_cfg


def _train_then_drop(rank: int, close: bool) -> dict:
    import gc
    import weakref

    from gspo_megatron.distributed.runtime import init_distributed, shutdown_distributed
    from gspo_megatron.learner.learner import Learner

    listening = []
    for _ in range(2):
        runtime = init_distributed(tiny_cfg().parallel, seed=3)
        learner = Learner(tiny_cfg(), runtime, total_steps=10)
        old = learner.compute_logprobs(make_batch(0)).logprobs  # RoPE's cache, the dispatcher
        learner.train_step(make_batch(0, old=old), _gspo())     # DDP hooks, optimizer shards
        chunk, optimizer = weakref.ref(learner.model[0]), weakref.ref(learner.optimizer)
        if close:
            learner.close()
            learner.close()  # twice is safe
        del learner, old
        shutdown_distributed()
        gc.collect()
        listening.append(listening_sockets())
    return {"chunk_alive": chunk() is not None, "optimizer_alive": optimizer() is not None,
            "listening": listening}


@pytest.mark.slow
def test_an_unclosed_learner_outlives_its_run_with_its_groups():
    out = run_on_ranks(_train_then_drop, world_size=1, close=False)[0]
    assert out["chunk_alive"] and out["optimizer_alive"]
    assert out["listening"][1] > out["listening"][0] > 0


@pytest.mark.slow
def test_a_closed_learner_is_freed_with_its_groups():
    out = run_on_ranks(_train_then_drop, world_size=1, close=True)[0]
    assert not out["chunk_alive"] and not out["optimizer_alive"]
    assert out["listening"] == [0, 0]

"""rollout/standin/memory_ledger.py: the stand-in's simulated GPU. Allocations that do not fit are
refused naming what is held; the server's static pool follows SGLang's mem_fraction_static of the
memory free at its start; release / resume move its tags; the reference server refuses a resume
that no longer fits (SGLang would fail with CUDA out of memory)."""

from __future__ import annotations

import pytest

from gspo_megatron.rollout.standin.memory_ledger import MemoryLedger, OutOfMemory, ServerMemory


def test_allocations_beyond_the_budget_are_refused_and_recorded(tmp_path):
    ledger = MemoryLedger.create(str(tmp_path / "gpu.json"), 100)
    ledger.allocate("learner", "resident", 60)
    with pytest.raises(OutOfMemory, match=r"learner/activations needs 50 bytes, 40 of 100 free .*"
                                          r"held: learner/resident 60"):
        ledger.allocate("learner", "activations", 50)
    assert ledger.free("learner", "resident") == 60 and ledger.free_bytes() == 100
    assert [e[0] for e in ledger.events()] == ["allocate", "refused", "free"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MemoryLedger(str(tmp_path / "missing.json"))


def test_the_server_pool_is_its_fraction_of_what_was_free_at_its_start(tmp_path):
    ledger = MemoryLedger.create(str(tmp_path / "gpu.json"), 1000)
    ledger.allocate("learner", "resident", 200)
    server = ServerMemory(ledger, "server:1", weights_bytes=100, mem_fraction_static=0.5)
    assert server.sizes == {"weights": 100, "kv_cache": 300, "cuda_graph": 0}  # 0.5 * 800
    server.release(["weights", "kv_cache", "cuda_graph"])
    assert ledger.free_bytes() == 800
    ledger.allocate("learner", "activations", 500)
    server.resume(["weights"])  # 100 fits beside 700
    with pytest.raises(OutOfMemory, match="server:1/kv_cache needs 300 bytes, 200 of 1000 free"):
        server.resume(["kv_cache"])
    with pytest.raises(OutOfMemory, match="does not hold the weights"):
        ServerMemory(ledger, "server:2", weights_bytes=100, mem_fraction_static=0.1)


def test_the_reference_server_refuses_a_resume_that_does_not_fit(tmp_path):
    from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
    from gspo_megatron.rollout.sglang import api
    from gspo_megatron.rollout.standin.server import ReferenceServer
    from gspo_megatron.tiny_task.model import build_tiny_policy

    model, tok = build_tiny_policy(seed=0)
    ledger = MemoryLedger.create(str(tmp_path / "gpu.json"), 10 ** 6)
    memory = ServerMemory(ledger, "server:x", weights_bytes=1000, mem_fraction_static=0.5)
    server = ReferenceServer(EmbeddedEngine(model, tok), enable_memory_saver=True, memory=memory)
    status, _ = server.handle_memory(api.RELEASE_MEMORY, {})
    assert status == 200 and ledger.free_bytes() == 10 ** 6
    ledger.allocate("learner", "resident", 900_000)
    status, body = server.handle_memory(api.RESUME_MEMORY, {})
    assert status == 400 and "out of memory: server:x/kv_cache needs 499000 bytes" in body["error"]["message"]
    assert server.scheduler.released == set(api.MEMORY_TAGS)  # nothing half-resumed in its view
    status, _ = server.handle_memory(api.RESUME_MEMORY, {"tags": ["weights"]})
    assert status == 200 and server.scheduler.released == {"kv_cache", "cuda_graph"}


def test_a_refused_resume_holds_nothing(tmp_path):
    ledger = MemoryLedger.create(str(tmp_path / "gpu.json"), 1000)
    server = ServerMemory(ledger, "server:1", weights_bytes=100, mem_fraction_static=0.5)
    server.release(["weights", "kv_cache"])
    ledger.allocate("learner", "resident", 800)
    with pytest.raises(OutOfMemory):
        server.resume(["weights", "kv_cache"])  # weights fit, the KV cache does not
    assert ledger.free_bytes() == 200 and "server:1/weights" not in ledger.state()["held"]

"""The staged, bucketed gather (checkpoint/gather.py) on 2 and 4 gloo processes.

A tiny Qwen3-MoE is filled from its HF checkpoint under each layout, then gathered back:
``dst="rank0"`` must hand rank 0 every HF tensor bit-identical (and nothing elsewhere);
``dst="stage"`` must hand each pipeline stage's first rank exactly its stage's tensors
(together: every tensor once), bit-identical, and nothing to the other ranks. Small buckets make
many collectives; layouts cover PP, EP, TP+SP with expert TP, and data-parallel replicas.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.config.schema import ParallelConfig
from tests.multiproc import run_on_ranks
from tests.test_checkpoint_convert import make_hf_model, reinit_layout


def _original(hf_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(hf_dir).state_dict().items()}


def _gather(rank: int, hf_dir: str, layout: dict) -> dict:
    from megatron.core import parallel_state as ps

    from gspo_megatron.checkpoint.convert import (build_model_chunks, fill_from_hf,
                                                  model_config_for_hf_dir)
    from gspo_megatron.checkpoint.gather import Layout, ReusedBuffers, iter_hf_buckets, new_buffer
    from gspo_megatron.checkpoint.hf_io import HFCheckpointReader
    from gspo_megatron.model.provider import padded_vocab_size

    parallel = ParallelConfig(**layout)
    reinit_layout(parallel)
    cfg = model_config_for_hf_dir(hf_dir)
    chunks = build_model_chunks(cfg, parallel)
    fill_from_hf(chunks, HFCheckpointReader(hf_dir), cfg,
                 padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, parallel.tp),
                 log_every=0)
    out = {"layout": Layout.current(cfg), "pp_rank": ps.get_pipeline_model_parallel_rank()}
    for dst in ("rank0", "stage", "reused"):  # reused: weight sync's buffers, dst rank0
        got, buckets = {}, 0
        alloc = ReusedBuffers() if dst == "reused" else new_buffer
        for bucket in iter_hf_buckets(chunks, cfg, bucket_bytes=6 * 1024,
                                      dst="rank0" if dst == "reused" else dst, alloc=alloc):
            buckets += 1
            assert len({t.dtype for _, t in bucket}) == 1
            for name, t in bucket:
                assert name not in got, f"{name} twice"
                got[name] = t.clone()
        out[dst], out[f"{dst}_buckets"] = got, buckets
    return out


LAYOUTS = [
    pytest.param(2, dict(pp=2), id="pp2"),
    pytest.param(4, dict(pp=2, ep=2), id="pp2-ep2"),
    pytest.param(4, dict(tp=2, sp=True, etp=2, pp=2), id="tp2-sp-etp2-pp2"),
    pytest.param(4, dict(ep=2), id="ep2-dp4-edp2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("world_size, layout", LAYOUTS)
def test_staged_bucketed_gather_is_exact(tmp_path, world_size, layout):
    hf_dir = make_hf_model("qwen3_moe", tmp_path / "hf")
    original = _original(str(hf_dir))
    results = run_on_ranks(_gather, world_size=world_size, hf_dir=str(hf_dir), layout=layout)
    on_rank0 = results[0]["rank0"]
    assert sorted(on_rank0) == sorted(original)
    assert [k for k in original if not torch.equal(original[k], on_rank0[k])] == []
    reused = results[0]["reused"]  # each bucket received where the one before it was
    assert sorted(reused) == sorted(original)
    assert [k for k in original if not torch.equal(original[k], reused[k])] == []
    assert all(r["rank0"] == {} for r in results[1:])
    assert results[0]["rank0_buckets"] > 5  # bucketed, not one collective per tensor
    leaders = [r for r in results if r["layout"].is_leader]
    assert len(leaders) == layout.get("pp", 1)
    seen = {}
    for r in results:
        if not r["layout"].is_leader:
            assert r["stage"] == {}, "only a stage's first rank receives its buckets"
            continue
        for name, t in r["stage"].items():
            assert name not in seen and torch.equal(t, original[name]), name
            seen[name] = r["pp_rank"]
    assert sorted(seen) == sorted(original)
    if layout.get("pp", 1) == 2:  # layer 0 + embeddings on stage 0, layer 1 + head on stage 1
        assert seen["model.embed_tokens.weight"] == 0 and seen["lm_head.weight"] == 1
        assert seen["model.layers.0.mlp.experts.3.down_proj.weight"] == 0
        assert seen["model.layers.1.self_attn.q_proj.weight"] == 1


def test_reused_buffers_keep_one_buffer_per_role_and_grow_when_needed():
    from gspo_megatron.checkpoint.gather import ReusedBuffers

    made = []

    def new(role, num_bytes, device):
        made.append((role, num_bytes))
        return torch.empty(num_bytes, dtype=torch.uint8, device=device)

    buffers = ReusedBuffers(new)
    first = buffers("received", 100, "cpu")
    again = buffers("received", 60, "cpu")  # a smaller bucket: a view of the same memory
    assert again.data_ptr() == first.data_ptr() and again.numel() == 60
    other = buffers("staging", 50, "cpu")  # alive beside "received": its own buffer
    assert other.data_ptr() != first.data_ptr()
    grown = buffers("received", 150, "cpu")
    assert grown.numel() == 150 and buffers("received", 100, "cpu").data_ptr() == grown.data_ptr()
    assert made == [("received", 100), ("staging", 50), ("received", 150)]
    buffers.release()
    buffers("received", 10, "cpu")
    assert made[-1] == ("received", 10)  # released: the next update allocates again

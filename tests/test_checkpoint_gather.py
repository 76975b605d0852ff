"""Gathering a distributed MoE model into full HF tensors on two gloo processes: conversion into
EP=2 exports bit-identical tensors and gives the transformers logits; under TP=2 + SP with expert
TP=2 (fused gate/up split per rank) ``iter_hf_tensors(dst="all")`` hands every rank the original
tensors, and ``dst="rank0"`` hands them to rank 0 only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gspo_megatron.config.schema import ParallelConfig
from tests.multiproc import run_on_ranks
from tests.test_checkpoint_convert import (assert_same_tensors, convert_export_and_logits,
                                           hf_logits, make_hf_model, reinit_layout)


def _original(hf_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    return {k: v.clone() for k, v in
            AutoModelForCausalLM.from_pretrained(hf_dir).state_dict().items()}


def _ep2_then_tp2(rank: int, hf_dir: str, work: str) -> dict:
    from gspo_megatron.checkpoint.convert import build_model_chunks
    from gspo_megatron.checkpoint.gather import iter_hf_tensors
    from gspo_megatron.learner.checkpointing import load_model_weights

    work_dir = Path(work)
    cfg, logits = convert_export_and_logits(hf_dir, work_dir, "ep2", ParallelConfig(ep=2),
                                            max_shard_bytes=40_000)

    tp2 = ParallelConfig(tp=2, sp=True, etp=2)
    reinit_layout(tp2)
    chunks = build_model_chunks(cfg, tp2)
    load_model_weights(chunks, work_dir / "ep2")  # saved under EP=2, loaded under TP=2/ETP=2
    original = _original(hf_dir)
    everywhere = dict(iter_hf_tensors(chunks, cfg, dst="all"))
    mismatched = sorted(k for k in original if not torch.equal(original[k], everywhere.get(k)))
    on_rank0 = dict(iter_hf_tensors(chunks, cfg, dst="rank0"))
    return {"logits": logits, "all_names": sorted(everywhere), "mismatched": mismatched,
            "rank0_count": len(on_rank0), "original_names": sorted(original)}


@pytest.mark.slow
def test_ep2_export_and_tp2_etp2_gather(tmp_path):
    hf_dir = make_hf_model("qwen3_moe", tmp_path / "hf")
    results = run_on_ranks(_ep2_then_tp2, world_size=2, hf_dir=str(hf_dir), work=str(tmp_path))
    assert assert_same_tensors(hf_dir, tmp_path / "hf_ep2") == 45
    reference = hf_logits(hf_dir)
    for r in results:
        assert torch.allclose(r["logits"], reference, atol=1e-4, rtol=1e-4)
        assert r["all_names"] == r["original_names"] and r["mismatched"] == []
    assert results[0]["rank0_count"] == 45 and results[1]["rank0_count"] == 0

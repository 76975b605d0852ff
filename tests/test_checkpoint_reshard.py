"""Resharding: a tiny tied-embedding dense Qwen3 converted into TP=2 (two gloo processes) exports
bit-identical tensors and gives the transformers logits; resharded to PP=2 the logits stay the
same and the new checkpoint records its layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gspo_megatron.config.schema import ParallelConfig
from tests.multiproc import run_on_ranks
from tests.test_checkpoint_convert import (TOKENS, VOCAB, assert_same_tensors,
                                           convert_export_and_logits, hf_logits, make_hf_model,
                                           megatron_logits, reinit_layout)



def _tp2_then_pp2(rank: int, hf_dir: str, work: str) -> dict:
    from gspo_megatron.checkpoint.convert import build_model_chunks
    from gspo_megatron.checkpoint.reshard import reshard_checkpoint
    from gspo_megatron.learner.checkpointing import load_model_weights

    work_dir = Path(work)
    cfg, logits_tp2 = convert_export_and_logits(hf_dir, work_dir, "tp2", ParallelConfig(tp=2),
                                                max_shard_bytes=30_000)

    pp2 = ParallelConfig(pp=2)
    reinit_layout(pp2)
    reshard_checkpoint(work_dir / "tp2", work_dir / "pp2", pp2)
    chunks = build_model_chunks(cfg, pp2)
    meta = load_model_weights(chunks, work_dir / "pp2")
    logits_pp2 = megatron_logits(chunks, TOKENS, VOCAB)
    return {"tp2": logits_tp2, "pp2": logits_pp2, "meta_parallel": meta["parallel"]}


@pytest.mark.slow
def test_convert_tp2_export_and_reshard_to_pp2(tmp_path):
    hf_dir = make_hf_model("qwen3", tmp_path / "hf", tied=True)
    results = run_on_ranks(_tp2_then_pp2, world_size=2, hf_dir=str(hf_dir), work=str(tmp_path))
    assert assert_same_tensors(hf_dir, tmp_path / "hf_tp2") == 2 * 11 + 2  # tied: no lm_head
    reference = hf_logits(hf_dir)
    tp2 = results[0]["tp2"]
    assert torch.allclose(tp2, results[1]["tp2"])
    assert torch.allclose(tp2, reference, atol=1e-4, rtol=1e-4), (tp2 - reference).abs().max()
    assert results[0]["pp2"] is None  # logits live on the last pipeline stage
    assert torch.allclose(results[1]["pp2"], tp2, atol=1e-5, rtol=1e-5)
    assert results[1]["meta_parallel"]["pp"] == 2 and results[1]["meta_parallel"]["tp"] == 1
    assert not list(tmp_path.glob("*.partial"))

"""Round trip on one process for a tiny Qwen3-MoE and a tiny dense Qwen3: convert -> Megatron
forward equals the transformers forward (fp32) -> export is bit-identical, complete (config,
generation config, tokenizer) and loads in transformers without missing or unexpected keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gspo_megatron.checkpoint.export import parse_size
from gspo_megatron.config.schema import ParallelConfig
from tests.multiproc import run_on_ranks
from tests.test_checkpoint_convert import (TOKENS, VOCAB, assert_same_tensors, hf_logits,
                                           make_hf_model, megatron_logits, reinit_layout)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1500") == 1500
    assert parse_size("0.5MB") == 500_000


def _round_trip(rank: int, cases: list) -> list:
    from gspo_megatron.checkpoint.convert import build_model_chunks, convert_hf_to_megatron
    from gspo_megatron.checkpoint.export import export_megatron_to_hf
    from gspo_megatron.checkpoint.meta import model_config_from_meta
    from gspo_megatron.learner.checkpointing import load_model_weights, read_meta

    parallel = ParallelConfig()
    reinit_layout(parallel)
    out = []
    for hf_dir, work in cases:
        work = Path(work)
        convert_hf_to_megatron(hf_dir, work / "mcore", parallel)
        cfg = model_config_from_meta(read_meta(work / "mcore"))
        chunks = build_model_chunks(cfg, parallel)
        load_model_weights(chunks, work / "mcore")
        logits = megatron_logits(chunks, TOKENS, VOCAB)
        export_megatron_to_hf(work / "mcore", work / "hf_out", parallel, max_shard_bytes=25_000)
        out.append(logits)
    return out


@pytest.mark.slow
def test_round_trip_moe_and_dense(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cases = []
    for kind in ("qwen3_moe", "qwen3"):
        hf_dir = make_hf_model(kind, tmp_path / kind / "hf")
        cases.append((str(hf_dir), str(tmp_path / kind)))
    (logits_moe, logits_dense), = run_on_ranks(_round_trip, world_size=1, cases=cases)
    for (hf_dir, work), logits, num_tensors in zip(cases, (logits_moe, logits_dense),
                                                   (2 * (8 + 1 + 4 * 3) + 3, 2 * 11 + 3)):
        hf_dir, out = Path(hf_dir), Path(work) / "hf_out"
        reference = hf_logits(hf_dir)
        assert torch.allclose(logits, reference, atol=1e-4, rtol=1e-4), \
            f"{hf_dir}: max |diff| {(logits - reference).abs().max()}"
        assert assert_same_tensors(hf_dir, out) == num_tensors
        assert len(list(out.glob("model-*.safetensors"))) > 1
        for name in ("config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json"):
            assert (out / name).is_file(), name
        assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
        model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        with torch.no_grad():
            assert torch.equal(model(TOKENS).logits, reference)
        assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("t5") == 5
        # the free-space check's estimate: within a few percent of what was written (sharded)
        from gspo_megatron.checkpoint.export import hf_export_nbytes
        from gspo_megatron.checkpoint.meta import model_config_from_meta
        from gspo_megatron.learner.checkpointing import read_meta

        cfg = model_config_from_meta(read_meta(Path(work) / "mcore"))
        written = sum(p.stat().st_size for p in out.iterdir())
        estimate = hf_export_nbytes(cfg, torch.float32, hf_dir)
        assert abs(estimate - written) < 0.05 * written, (estimate, written)


def test_config_json_keeps_source_fields_and_recipe(tmp_path, caplog):
    from dataclasses import replace

    from gspo_megatron.checkpoint.export import _hf_config
    from gspo_megatron.config.schema import ModelConfig

    source = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "router_aux_loss_coef": 0.001,
              "bos_token_id": 7, "use_cache": True, "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(source))
    cfg = ModelConfig(num_layers=2, hidden_size=64, moe_aux_loss_coeff=0.0)
    out = _hf_config(cfg, tmp_path, torch.bfloat16)
    assert out["router_aux_loss_coef"] == 0.001  # the source's recipe, not the RL run's 0.0
    assert out["bos_token_id"] == 7 and out["use_cache"] is True
    assert out["torch_dtype"] == "bfloat16" and out["num_experts"] == cfg.num_experts
    assert not caplog.records
    changed = _hf_config(replace(cfg, num_layers=3), tmp_path, torch.float32)
    assert changed["num_hidden_layers"] == 3 and "num_hidden_layers: 2 -> 3" in caplog.text
    alone = _hf_config(cfg, None, torch.float32)
    assert alone["router_aux_loss_coef"] == 0.0

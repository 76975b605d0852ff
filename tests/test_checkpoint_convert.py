"""HF -> Megatron conversion: bad input (missing shard, truncated file, config that does not match
the weights, unsupported architecture, existing output) is refused with the file / key named and
nothing is left at the target. Also the shared helpers of the checkpoint tests: tiny HF models
built with transformers, Megatron logits through Megatron's schedule, tensor comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
from gspo_megatron.checkpoint.hf_io import HFCheckpointError
from gspo_megatron.config import ConfigError
from gspo_megatron.config.schema import ParallelConfig

VOCAB = 90
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def make_hf_model(kind: str, out_dir: Path, tied: bool = False, num_layers: int = 2,
                  extra: dict | None = None) -> Path:
    """A tiny random Qwen3 (dense) or Qwen3-MoE saved in several safetensors shards; ``extra``
    adds config.json fields."""
    from transformers import (PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    from tokenizers import Tokenizer, models

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=tied,
                  torch_dtype="float32", bos_token_id=1, eos_token_id=2, **(extra or {}))
    torch.manual_seed(0 if kind == "qwen3" else 1)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=16, norm_topk_prob=True))
    with torch.no_grad():  # norms start at 1: perturb them so a wrong norm mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out_dir, max_shard_size="40KB", safe_serialization=True)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0")),
                                  model_input_names=["input_ids", "attention_mask"])
    tok.save_pretrained(out_dir)
    return out_dir


def hf_logits(hf_dir: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def megatron_logits(chunks, tokens: torch.Tensor, vocab: int):
    """Forward through Megatron's schedule; full-vocab logits on the last stage, else None."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = tokens.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)

    def step(data_iterator, model):
        out = model(tokens, position_ids, mask)
        return out, lambda o: (o.float().sum() * 0, {"logits": o.detach()})

    for c in chunks:
        c.eval()
    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([0]), model=list(chunks),
            num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    logits = results[0]["logits"]
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        torch.distributed.all_gather(parts, logits.contiguous(),
                                     group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab]


def assert_same_tensors(original_dir: Path, exported_dir: Path) -> int:
    """Every tensor bit-identical, same names; returns the number of tensors compared."""
    from safetensors import safe_open

    def load_all(d: Path):
        index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        out = {}
        for f in sorted(set(index.values())):
            with safe_open(str(d / f), framework="pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
        return out

    a, b = load_all(original_dir), load_all(exported_dir)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    return len(a)


def reinit_layout(parallel: ParallelConfig) -> None:
    """Switch Megatron's parallel layout inside the running process group."""
    from megatron.core import parallel_state

    from gspo_megatron.distributed.runtime import init_distributed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    init_distributed(parallel, seed=3)


def convert_export_and_logits(hf_dir, work_dir: Path, name: str, parallel: ParallelConfig,
                              max_shard_bytes: int):
    """Under ``parallel``: convert ``hf_dir`` to ``work_dir/name``, export it to
    ``work_dir/hf_name``, load it back into fresh chunks; returns (model config, logits)."""
    from gspo_megatron.checkpoint.convert import build_model_chunks
    from gspo_megatron.checkpoint.export import export_megatron_to_hf
    from gspo_megatron.checkpoint.meta import model_config_from_meta
    from gspo_megatron.learner.checkpointing import load_model_weights, read_meta

    reinit_layout(parallel)
    convert_hf_to_megatron(hf_dir, work_dir / name, parallel)
    export_megatron_to_hf(work_dir / name, work_dir / f"hf_{name}", parallel,
                          max_shard_bytes=max_shard_bytes)
    cfg = model_config_from_meta(read_meta(work_dir / name))
    chunks = build_model_chunks(cfg, parallel)
    load_model_weights(chunks, work_dir / name)
    return cfg, megatron_logits(chunks, TOKENS, VOCAB)


# --------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return make_hf_model("qwen3", tmp_path_factory.mktemp("hf") / "dense")


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _convert_expecting(exc_type, match: str, hf_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "mcore"
    with pytest.raises(exc_type, match=match):
        convert_hf_to_megatron(hf_dir, out, ParallelConfig())
    assert not out.exists()


def test_missing_shard_is_named(dense_dir, tmp_path):
    d = _copy(dense_dir, tmp_path / "hf")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    _convert_expecting(HFCheckpointError, f"{shard.name}: shard listed .* is missing", d, tmp_path)


def test_truncated_shard_is_named(dense_dir, tmp_path):
    d = _copy(dense_dir, tmp_path / "hf")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    _convert_expecting(HFCheckpointError, f"{shard.name}: truncated", d, tmp_path)


def test_config_that_does_not_match_weights_names_key(dense_dir, tmp_path):
    d = _copy(dense_dir, tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    _convert_expecting(HFCheckpointError,
                       r"config.json: 'intermediate_size' is 48 but the checkpoint's tensors hold 64 "
                       r"\(.*'model.layers.0.mlp.gate_proj.weight' has shape \[64, 32\]\)", d, tmp_path)


def test_unsupported_architecture_is_refused(dense_dir, tmp_path):
    d = _copy(dense_dir, tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    _convert_expecting(ConfigError, "config.json: model_type 'llama' is not supported", d, tmp_path)


def test_existing_target_is_not_overwritten(dense_dir, tmp_path):
    out = tmp_path / "mcore"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(FileExistsError, match="already exists"):
        convert_hf_to_megatron(dense_dir, out, ParallelConfig())
    assert (out / "keep").read_text() == "x"

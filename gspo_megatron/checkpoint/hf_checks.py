"""Check a Hugging Face checkpoint against its config.json, naming the key that disagrees.

:meth:`HFCheckpointReader.validate` compares every tensor with the shape config.json implies, but
its error names a tensor: ``q_proj has shape [2048, 2048] but config.json implies [4096, 2048]``
leaves the user to work out whether ``num_attention_heads`` or ``head_dim`` is wrong. Here the
geometry is first read back from the tensors (head_dim from ``q_norm``, the vocabulary from the
embedding, the expert count from the router and the expert tensors present, ...), and the first
key whose value the tensors contradict is named together with the tensor that shows it. The
shape-by-shape check still follows, so anything the keys do not explain is caught as before.

A tokenizer with more tokens than ``vocab_size`` is refused too: its last ids have no embedding
row, and the first prompt or sample that uses one fails deep inside an embedding lookup.

    reader, unused = open_validated(hf_dir, model_config_for_hf_dir(hf_dir))
    check_tokenizer_fits(len(tokenizer), cfg.vocab_size, tokenizer_file, config_file)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional, Tuple

from gspo_megatron.checkpoint.hf_io import HFCheckpointError, HFCheckpointReader
from gspo_megatron.checkpoint.mapping import expected_hf_shapes
from gspo_megatron.config.schema import ModelConfig

_LAYER0 = "model.layers.0."
# (config.json key, ModelConfig field, tensor, dimension, field the dimension is a multiple of)
_PROBES: Tuple[Tuple[str, str, str, int, Optional[str]], ...] = (
    ("vocab_size", "vocab_size", "model.embed_tokens.weight", 0, None),
    ("hidden_size", "hidden_size", "model.embed_tokens.weight", 1, None),
    ("head_dim", "head_dim", _LAYER0 + "self_attn.q_norm.weight", 0, None),
    ("num_attention_heads", "num_attention_heads", _LAYER0 + "self_attn.q_proj.weight", 0,
     "head_dim"),
    ("num_key_value_heads", "num_query_groups", _LAYER0 + "self_attn.k_proj.weight", 0,
     "head_dim"),
    ("num_experts", "num_experts", _LAYER0 + "mlp.gate.weight", 0, None),
    ("moe_intermediate_size", "moe_ffn_hidden_size", _LAYER0 + "mlp.experts.0.gate_proj.weight",
     0, None),
    ("intermediate_size", "ffn_hidden_size", _LAYER0 + "mlp.gate_proj.weight", 0, None),
)
_EXPERT = re.compile(r"^model\.layers\.0\.mlp\.experts\.(\d+)\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _disagree(config_file: str, key: str, expected: int, found: int, evidence: str) -> None:
    raise HFCheckpointError(f"{config_file}: '{key}' is {expected} but the checkpoint's tensors "
                            f"hold {found} ({evidence})")


def _check_probes(reader: HFCheckpointReader, cfg: ModelConfig, config_file: str) -> None:
    for key, field, name, dim, per in _PROBES:
        if name not in reader.weight_map:
            continue  # a missing tensor is reported by the shape-by-shape check
        shape = reader.shape(name)
        if dim >= len(shape):
            continue
        unit = getattr(cfg, per) if per else 1
        found, expected = shape[dim] // unit, getattr(cfg, field)
        if shape[dim] % unit == 0 and found != expected:
            _disagree(config_file, key, expected, found,
                      f"{reader.dir / reader.weight_map[name]}: '{name}' has shape {list(shape)}")


def _check_counts(reader: HFCheckpointReader, cfg: ModelConfig, config_file: str) -> None:
    """Fewer layers or experts than config.json says (more is left to the unused-tensor report)."""
    layers = {int(m.group(1)) for m in map(_LAYER.match, reader.weight_map) if m}
    if layers and len(layers) < cfg.num_layers:
        _disagree(config_file, "num_hidden_layers", cfg.num_layers, len(layers),
                  f"{reader.dir} has tensors of layers {sorted(layers)[:8]}")
    experts = {int(m.group(1)) for m in map(_EXPERT.match, reader.weight_map) if m}
    if cfg.num_experts and experts and len(experts) < cfg.num_experts:
        _disagree(config_file, "num_experts", cfg.num_experts, len(experts),
                  f"{reader.dir} has layer 0's experts {min(experts)}..{max(experts)}")


def open_validated(hf_dir: str | Path, cfg: ModelConfig) -> Tuple[HFCheckpointReader, List[str]]:
    """A reader of ``hf_dir`` whose shards exist and whose tensors match ``cfg`` (the sizes of
    its config.json), and the checkpoint's tensors ``cfg`` does not use."""
    reader = HFCheckpointReader(hf_dir)
    reader.check_files()  # a truncated shard is named as such before its header is read
    config_file = str(Path(hf_dir) / "config.json")
    _check_probes(reader, cfg, config_file)
    _check_counts(reader, cfg, config_file)
    return reader, reader.validate(expected_hf_shapes(cfg), config_file)


def check_tokenizer_fits(num_tokens: int, vocab_size: int, tokenizer_file: str | Path,
                         config_file: str | Path) -> None:
    """Every token id of a tokenizer of ``num_tokens`` tokens has a row in the embedding."""
    if num_tokens > vocab_size:
        raise HFCheckpointError(
            f"{tokenizer_file}: the tokenizer has {num_tokens} tokens but {config_file}: "
            f"'vocab_size' is {vocab_size}; ids {vocab_size}..{num_tokens - 1} have no "
            "embedding row")

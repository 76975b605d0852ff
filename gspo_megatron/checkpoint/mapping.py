"""The one Hugging Face <-> Megatron-Core weight mapping for Qwen3 and Qwen3-MoE.

Used by conversion (HF -> Megatron), export (Megatron -> HF), resharding, and the learner ->
rollout weight sync. Three layers, each pure and small:

1. **Local names -> canonical names.** A Megatron parameter name on one rank (Transformer Engine
   or local layer spec; sequential experts, TE grouped-GEMM experts ``linear_fc1.weight{e}``, or
   legacy ``GroupedMLP`` ``weight1``/``weight2``) is rewritten to a *canonical* name: the
   local-spec, sequential-expert name with the **global** layer and expert index, e.g.
   ``decoder.layers.7.mlp.experts.local_experts.93.linear_fc1.weight``.
2. **Shard specs.** Each canonical name has a fixed :class:`ShardSpec` saying how its full tensor
   is split across tensor-parallel ranks: not at all, along dim 0 (column parallel, vocab), along
   dim 1 (row parallel), or as a fused gate/up (SwiGLU) pair where every rank holds
   ``[gate_slice; up_slice]``. Experts use the expert-tensor-parallel group.
3. **Full tensors <-> HF tensors.** Fused QKV with GQA grouping (Megatron stores, per query
   group, that group's query heads then its key head then its value head), fused gate/up, vocab
   padding (added on import, cut on export), tied embeddings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Protocol, Tuple

import torch

from gspo_megatron.config.schema import ModelConfig


class MappingError(ValueError):
    """A parameter name or tensor that the Qwen3 mapping does not know how to handle."""


@dataclass(frozen=True)
class ShardSpec:
    """How the full (TP=1) Megatron tensor of one canonical parameter is split over TP ranks."""

    dim: Optional[int]
    """Split dimension; None means every rank holds the whole tensor."""
    glu: bool = False
    """Fused gate/up: each rank holds its slice of gate stacked on its slice of up (dim 0)."""
    expert: bool = False
    """Split over the expert-tensor-parallel group instead of the tensor-parallel group."""


REPLICATED = ShardSpec(dim=None)

_LAYER = r"decoder\.layers\.(\d+)\."
# Local parameter suffixes (after "decoder.layers.{i}.") -> canonical suffixes.
_LAYER_ALIASES: Dict[str, str] = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE fused norm
    "pre_mlp_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",  # TE fused norm (dense)
    "self_attention.linear_qkv.weight": "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight": "self_attention.linear_proj.weight",
    "self_attention.q_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attention.k_layernorm.weight": "self_attention.k_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
    "mlp.router.weight": "mlp.router.weight",
}
_SEQUENTIAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_TE_GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
_LEGACY_GROUPED_EXPERT = re.compile(r"mlp\.experts\.(weight[12])$")
_TOP_LEVEL = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
              "output_layer.weight"}


def expert_name(layer: int, expert: int, fc: str) -> str:
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{fc}.weight"


def canonical_name(local_name: str, layer_offset: Callable[[int], int],
                   expert_offset: int) -> str:
    """Canonical global name of one local parameter.

    ``layer_offset(i)`` gives the global layer index of local layer ``i`` (PP / VPP);
    ``expert_offset`` is the global index of this rank's first expert (EP). Legacy grouped
    ``weight1``/``weight2`` hold several experts and are expanded by the caller
    (see :func:`legacy_grouped_fc`); asking for one here is an error.
    """
    if local_name in _TOP_LEVEL:
        return local_name
    m = re.match(_LAYER + r"(.*)$", local_name)
    if not m:
        raise MappingError(f"unknown Megatron parameter '{local_name}'")
    layer, rest = layer_offset(int(m.group(1))), m.group(2)
    if rest in _LAYER_ALIASES:
        return f"decoder.layers.{layer}.{_LAYER_ALIASES[rest]}"
    e = _SEQUENTIAL_EXPERT.match(rest)
    if e:
        return expert_name(layer, expert_offset + int(e.group(1)), e.group(2))
    e = _TE_GROUPED_EXPERT.match(rest)
    if e:
        return expert_name(layer, expert_offset + int(e.group(2)), e.group(1))
    raise MappingError(f"unknown Megatron parameter '{local_name}' (layer suffix '{rest}')")


def legacy_grouped_fc(local_name: str) -> Optional[str]:
    """``linear_fc1``/``linear_fc2`` for a legacy GroupedMLP ``weight1``/``weight2``, else None."""
    m = re.match(_LAYER + r"(.*)$", local_name)
    if not m:
        return None
    e = _LEGACY_GROUPED_EXPERT.match(m.group(2))
    return None if not e else {"weight1": "linear_fc1", "weight2": "linear_fc2"}[e.group(1)]


def shard_spec(name: str) -> ShardSpec:
    """Tensor-parallel split of a canonical parameter."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return ShardSpec(dim=0)
    is_expert = ".mlp.experts." in name
    if name.endswith("linear_qkv.weight"):
        return ShardSpec(dim=0)
    if name.endswith("linear_fc1.weight"):
        return ShardSpec(dim=0, glu=True, expert=is_expert)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return ShardSpec(dim=1, expert=is_expert)
    return REPLICATED


def _adjacent(parts: List[torch.Tensor]) -> bool:
    """Whether the parts lie back to back in one storage, each contiguous: then their
    concatenation along dim 0 is a view of that storage."""
    first = parts[0]
    end = first.data_ptr()
    for p in parts:
        if (not p.is_contiguous() or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]
                or p.data_ptr() != end or p.untyped_storage().data_ptr()
                != first.untyped_storage().data_ptr()):
            return False
        end += p.numel() * p.element_size()
    return True


def unshard(parts: List[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every rank's slice in rank order (the inverse of
    :func:`local_from_hf`'s split; a view of the parts' memory, not a copy, when they lie back
    to back along dim 0)."""
    if spec.dim is None or len(parts) == 1:
        return parts[0]
    if spec.glu:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if spec.dim == 0 and _adjacent(parts):
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        return parts[0].as_strided(shape, strides)
    return torch.cat(parts, dim=spec.dim)


# ----------------------------------------------------------------------------- HF side

def _layer_hf(cfg: ModelConfig, layer: int, suffix: str) -> List[str]:
    p = f"model.layers.{layer}."
    table = {
        "input_layernorm.weight": [p + "input_layernorm.weight"],
        "pre_mlp_layernorm.weight": [p + "post_attention_layernorm.weight"],
        "self_attention.linear_qkv.weight": [p + "self_attn.q_proj.weight",
                                             p + "self_attn.k_proj.weight",
                                             p + "self_attn.v_proj.weight"],
        "self_attention.linear_proj.weight": [p + "self_attn.o_proj.weight"],
        "self_attention.q_layernorm.weight": [p + "self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": [p + "self_attn.k_norm.weight"],
        "mlp.linear_fc1.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        "mlp.linear_fc2.weight": [p + "mlp.down_proj.weight"],
        "mlp.router.weight": [p + "mlp.gate.weight"],
    }
    if suffix in table:
        return table[suffix]
    e = _SEQUENTIAL_EXPERT.match(suffix)
    if e:
        q = f"{p}mlp.experts.{e.group(1)}."
        return ([q + "gate_proj.weight", q + "up_proj.weight"] if e.group(2) == "linear_fc1"
                else [q + "down_proj.weight"])
    raise MappingError(f"no Hugging Face name for 'decoder.layers.{layer}.{suffix}'")


def hf_names(name: str, cfg: ModelConfig) -> List[str]:
    """HF tensors that make up a canonical Megatron parameter, in fusion order.

    For the output layer of a model with tied embeddings this is the embedding (import reads it;
    :func:`is_exported` keeps export from writing it twice).
    """
    if name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if name == "output_layer.weight":
        return ["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    if name == "decoder.final_layernorm.weight":
        return ["model.norm.weight"]
    m = re.match(_LAYER + r"(.*)$", name)
    if not m:
        raise MappingError(f"no Hugging Face name for '{name}'")
    return _layer_hf(cfg, int(m.group(1)), m.group(2))


def is_exported(name: str, cfg: ModelConfig) -> bool:
    """False for the output layer of a tied model (the HF checkpoint has only the embedding)."""
    return not (name == "output_layer.weight" and cfg.tie_word_embeddings)


def canonical_names(cfg: ModelConfig) -> List[str]:
    """Every canonical parameter of the model, in HF checkpoint order."""
    names = ["embedding.word_embeddings.weight"]
    for layer in range(cfg.num_layers):
        p = f"decoder.layers.{layer}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight",
                  p + "self_attention.linear_proj.weight"]
        if cfg.qk_layernorm:
            names += [p + "self_attention.q_layernorm.weight",
                      p + "self_attention.k_layernorm.weight"]
        names.append(p + "pre_mlp_layernorm.weight")
        if cfg.num_experts:
            names.append(p + "mlp.router.weight")
            for e in range(cfg.num_experts):
                names += [expert_name(layer, e, "linear_fc1"), expert_name(layer, e, "linear_fc2")]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    if not cfg.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def hf_file_order(names: List[str]) -> List[str]:
    """HF names in the hub's file order: the embedding first, then the layers in order, the
    final norm and lm_head last (the mapping's order within a layer is kept)."""
    def rank(name: str) -> int:
        if name.startswith("model.embed_tokens"):
            return 0
        return 1 if name.startswith("model.layers.") else 2
    return sorted(names, key=rank)


def expected_hf_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Shape of every HF tensor the config implies (to check weights against config.json)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    shapes: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.num_attention_heads * hd, h),
            p + "self_attn.k_proj.weight": (cfg.num_query_groups * hd, h),
            p + "self_attn.v_proj.weight": (cfg.num_query_groups * hd, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * hd)})
        if cfg.qk_layernorm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if cfg.num_experts:
            shapes[p + "mlp.gate.weight"] = (cfg.num_experts, h)
            f = cfg.moe_ffn_hidden_size
            for e in range(cfg.num_experts):
                q = f"{p}mlp.experts.{e}."
                shapes.update({q + "gate_proj.weight": (f, h), q + "up_proj.weight": (f, h),
                               q + "down_proj.weight": (h, f)})
        else:
            f = cfg.ffn_hidden_size
            shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                           p + "mlp.down_proj.weight": (h, f)})
    return shapes


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF q/k/v [heads*hd, h] -> Megatron linear_qkv [groups*(heads/group + 2)*hd, h]."""
    groups, hd = cfg.num_query_groups, cfg.head_dim
    h = q.shape[-1]
    per_group = cfg.num_attention_heads // groups
    return torch.cat([q.reshape(groups, per_group * hd, h), k.reshape(groups, hd, h),
                      v.reshape(groups, hd, h)], dim=1).reshape(-1, h)


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> Tuple[torch.Tensor, ...]:
    """Inverse of :func:`fuse_qkv`."""
    groups, hd = cfg.num_query_groups, cfg.head_dim
    h = qkv.shape[-1]
    per_group = cfg.num_attention_heads // groups
    q, k, v = qkv.reshape(groups, (per_group + 2) * hd, h).split([per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def pad_vocab(t: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Append zero rows up to the padded vocabulary (rows Megatron adds for TP alignment)."""
    extra = padded_rows - t.shape[0]
    if extra < 0:
        raise MappingError(f"vocabulary of {t.shape[0]} rows exceeds the padded size {padded_rows}")
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, *t.shape[1:])], dim=0)


def hf_to_megatron(name: str, tensors: List[torch.Tensor], cfg: ModelConfig,
                   padded_vocab: int) -> torch.Tensor:
    """Full canonical tensor from its HF tensors (in :func:`hf_names` order)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return pad_vocab(tensors[0], padded_vocab)
    if name.endswith("linear_qkv.weight"):
        return fuse_qkv(*tensors, cfg)
    if name.endswith("linear_fc1.weight"):
        return torch.cat(tensors, dim=0)
    return tensors[0]


class SliceReader(Protocol):
    """What :func:`local_from_hf` reads HF tensors through (``hf_io.HFCheckpointReader``)."""

    def get(self, name: str) -> torch.Tensor: ...

    def shape(self, name: str) -> Tuple[int, ...]: ...

    def get_slice(self, name: str, index: Tuple[slice, ...]) -> torch.Tensor: ...


def _even(total: int, size: int, name: str) -> int:
    if total % size:
        raise MappingError(f"'{name}': {total} does not split into {size} equal parts")
    return total // size


def local_from_hf(name: str, reader: SliceReader, cfg: ModelConfig, spec: ShardSpec, rank: int,
                  size: int, padded_vocab: int) -> torch.Tensor:
    """This rank's slice of canonical ``name`` (rank ``rank`` of the ``size`` it is split over,
    per ``spec``), read from only the parts of its HF tensors that the slice holds: the full
    tensor is never built. Equals ``hf_to_megatron(...)`` cut into ``size`` parts along the
    spec (fused gate/up: each half cut; QKV: whole query groups; vocabulary: padded rows)."""
    names = hf_names(name, cfg)
    if spec.dim is None or size == 1:
        return hf_to_megatron(name, [reader.get(n) for n in names], cfg, padded_vocab)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        rows = _even(padded_vocab, size, name)
        start = rank * rows
        stop = max(start, min(start + rows, cfg.vocab_size))
        return pad_vocab(reader.get_slice(names[0], (slice(start, stop),)), rows)
    if name.endswith("linear_qkv.weight"):
        groups, hd = _even(cfg.num_query_groups, size, name), cfg.head_dim
        heads = cfg.num_attention_heads // cfg.num_query_groups * groups
        q = reader.get_slice(names[0], (slice(rank * heads * hd, (rank + 1) * heads * hd),))
        k, v = (reader.get_slice(n, (slice(rank * groups * hd, (rank + 1) * groups * hd),))
                for n in names[1:])
        return fuse_qkv(q, k, v, replace(cfg, num_query_groups=groups, num_attention_heads=heads))
    part = _even(reader.shape(names[0])[spec.dim], size, name)
    cut = slice(rank * part, (rank + 1) * part)
    index = (cut,) if spec.dim == 0 else (slice(None), cut)
    pieces = [reader.get_slice(n, index) for n in names]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)  # gate/up: each half


def megatron_to_hf(name: str, full: torch.Tensor,
                   cfg: ModelConfig) -> List[Tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one full canonical tensor; vocabulary padding removed."""
    if not is_exported(name, cfg):
        return []
    names = hf_names(name, cfg)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return [(names[0], full[: cfg.vocab_size])]
    if name.endswith("linear_qkv.weight"):
        return list(zip(names, split_qkv(full, cfg)))
    if name.endswith("linear_fc1.weight"):
        return list(zip(names, full.chunk(2, dim=0)))
    return [(names[0], full)]

"""Parameter counts of a Qwen3 / Qwen3-MoE GPTModel per pipeline stage and rank.

Counts what Megatron-Core builds (``model/provider.py``): fused QKV and gate/up split over TP,
RMSNorm weights (input, pre-MLP, per-head q/k norms, final) replicated on every TP rank, the
router ``[E, h]`` replicated, experts split over EP (whole experts) and ETP (inside an expert),
the embedding padded to ``make_vocab_size_divisible_by * tp`` rows. With tied embeddings and
PP > 1 the last stage keeps its own copy of the embedding for the output layer (Megatron's
shared-embedding scheme). ``tests/test_planner_model_shape.py`` compares these numbers with the
``numel`` of models Megatron builds on CPU.

Parameters fall in two groups because their gradients and distributed-optimizer shards live in
different groups: *dense* ones over data x context parallel ranks, *expert* ones over the
expert-data-parallel ranks (``world / (pp * ep * etp)``).

Megatron's ``theoretical_memory_usage.py`` (Megatron-LM, megatron/training/) counts the same
attention and MLP terms but leaves out QK-norm and router weights; ``docs/planner.md`` compares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional

from gspo_megatron.config.pipeline_split import stage_layer_counts


@dataclass(frozen=True)
class ModelShape:
    """Architecture sizes, in ModelConfig's names."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    make_vocab_size_divisible_by: int = 128
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    qk_layernorm: bool = True
    tie_word_embeddings: bool = False

    @classmethod
    def from_model_config(cls, m) -> "ModelShape":
        """From a ModelConfig (dataclass or OmegaConf node); dense models get 0 experts."""
        return cls(num_layers=m.num_layers, hidden_size=m.hidden_size,
                   ffn_hidden_size=m.ffn_hidden_size, num_attention_heads=m.num_attention_heads,
                   num_query_groups=m.num_query_groups, head_dim=m.head_dim,
                   vocab_size=m.vocab_size, make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
                   num_experts=m.num_experts if m.arch == "qwen3_moe" else 0,
                   moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
                   qk_layernorm=m.qk_layernorm, tie_word_embeddings=m.tie_word_embeddings)

    @property
    def is_moe(self) -> bool:
        """Routed experts in every layer (Qwen3-MoE)."""
        return self.num_experts > 0

    def padded_vocab(self, tp: int) -> int:
        """Megatron's padded vocabulary (``model/provider.py: padded_vocab_size``)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def total_params(self) -> int:
        """Parameters of the whole model (unpadded vocabulary), as in the HF checkpoint."""
        return ParamCounts.for_stage(self, Layout(), 0).total - \
            self.hidden_size * (self.padded_vocab(1) - self.vocab_size) * (
                1 if self.tie_word_embeddings else 2)

    def active_params(self) -> int:
        """Parameters one token passes through (top-k experts instead of all)."""
        if not self.is_moe:
            return self.total_params()
        unused = self.num_experts - self.moe_router_topk
        return self.total_params() - self.num_layers * unused * 3 * self.hidden_size * \
            self.moe_ffn_hidden_size


@dataclass(frozen=True)
class Layout:
    """One learner layout. ``world_size`` = learner GPUs."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    sp: bool = False
    vpp: Optional[int] = None
    world_size: int = 1
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    @classmethod
    def from_parallel_config(cls, p, world_size: int) -> "Layout":
        """From a ParallelConfig and the learner world size."""
        return cls(tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp, cp=p.cp, sp=p.sp, vpp=p.vpp,
                   world_size=world_size,
                   first_stage_layers=p.num_layers_in_first_pipeline_stage,
                   last_stage_layers=p.num_layers_in_last_pipeline_stage)

    @property
    def dp(self) -> int:
        """Data-parallel size (without CP)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def dense_shard_group(self) -> int:
        """Ranks the distributed optimizer shards dense state over: DP x CP."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size: ranks holding the same experts."""
        return self.world_size // (self.pp * self.ep * self.etp)

    def stage_layers(self, num_layers: int) -> List[int]:
        """Layers per pipeline stage (``config/pipeline_split.py``)."""
        return stage_layer_counts(num_layers, self.pp, self.first_stage_layers,
                                  self.last_stage_layers)

    def overrides(self) -> List[str]:
        """The ``parallel.*`` config overrides of this layout."""
        out = [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.ep={self.ep}",
               f"parallel.etp={self.etp}", f"parallel.cp={self.cp}",
               f"parallel.sp={str(self.sp).lower()}", f"parallel.world_size={self.world_size}"]
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            out += [f"parallel.num_layers_in_first_pipeline_stage={self.first_stage_layers}",
                    f"parallel.num_layers_in_last_pipeline_stage={self.last_stage_layers}"]
        else:  # clear a split the config may set
            out += ["parallel.num_layers_in_first_pipeline_stage=null",
                    "parallel.num_layers_in_last_pipeline_stage=null"]
        return out


@dataclass(frozen=True)
class ParamCounts:
    """Parameters on one rank of one pipeline stage."""

    dense: int
    """Reduced and sharded over DP x CP."""
    expert: int
    """Reduced and sharded over the expert-data-parallel group."""
    linear: int
    """Weights of linear layers inside transformer layers (FP8 candidates), included above."""
    layers: int
    """Transformer layers on this stage."""
    frozen_dense: int = 0
    """Of ``dense``, parameters of the ``optimizer.freeze`` groups (no grads, no optimizer state)."""
    frozen_expert: int = 0
    """Of ``expert``, frozen ones (the ``experts`` group)."""

    @property
    def total(self) -> int:
        """Dense + expert parameters on this rank."""
        return self.dense + self.expert

    @property
    def trainable_dense(self) -> int:
        return self.dense - self.frozen_dense

    @property
    def trainable_expert(self) -> int:
        return self.expert - self.frozen_expert

    @property
    def trainable(self) -> int:
        """Parameters with a gradient-buffer slot and optimizer state."""
        return self.trainable_dense + self.trainable_expert

    @classmethod
    def for_stage(cls, shape: ModelShape, layout: Layout, stage: int,
                  frozen: Iterable[str] = ()) -> "ParamCounts":
        """Parameters one rank of pipeline stage ``stage`` holds; ``frozen``: the
        ``optimizer.freeze`` groups (``config/freeze.py``) counted apart."""
        h, d, tp = shape.hidden_size, shape.head_dim, layout.tp
        layers = layout.stage_layers(shape.num_layers)[stage]
        qkv = h * (shape.num_attention_heads + 2 * shape.num_query_groups) * d // tp
        proj = shape.num_attention_heads * d * h // tp
        norms = 2 * h + (2 * d if shape.qk_layernorm else 0)
        if shape.is_moe:
            router = shape.num_experts * h
            mlp_dense = 0
            experts = (shape.num_experts // layout.ep) * 3 * h * shape.moe_ffn_hidden_size \
                // layout.etp
        else:
            router, experts = 0, 0
            mlp_dense = 3 * h * shape.ffn_hidden_size // tp
        dense = layers * (qkv + proj + norms + router + mlp_dense)
        linear = layers * (qkv + proj + mlp_dense + experts)
        embedding = shape.padded_vocab(tp) * h // tp
        first, last = stage == 0, stage == layout.pp - 1
        groups = {"attention": layers * (qkv + proj), "norms": layers * norms,
                  "router": layers * router, "mlp": layers * mlp_dense, "embedding": 0,
                  "output_layer": 0}
        if first:
            dense += embedding
            groups["embedding"] = embedding
        if last:
            dense += h  # final norm
            groups["norms"] += h
            if not shape.tie_word_embeddings or layout.pp > 1:
                dense += embedding  # output layer (or the last stage's copy of a tied one)
                groups["output_layer"] = embedding
        frozen = set(frozen)
        return cls(dense=dense, expert=layers * experts, linear=linear, layers=layers,
                   frozen_dense=sum(n for g, n in groups.items() if g in frozen),
                   frozen_expert=layers * experts if "experts" in frozen else 0)

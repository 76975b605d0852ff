"""Named parameter groups that ``optimizer.freeze`` can keep out of training, and its rules.

A frozen group keeps its weights as loaded: the learner sets ``requires_grad=False`` on its
parameters before Megatron's DDP and optimizer are built (``learner/freeze.py``), so they get no
fp32 gradient buffer, no fp32 main weights and no Adam moments. They stay in checkpoints, exports
and every weight sync (the rollout engine needs the whole model). What that saves per group is
the planner's (``planner/model_shape.py``; ``docs/learner.md``, "Freezing parameter groups").

    optimizer:
      freeze: [embedding, output_layer]    # Qwen3-30B-A3B at 1 layer: half its parameters

Groups, by Megatron-Core parameter name (local and Transformer Engine specs):

* ``embedding``: ``embedding.word_embeddings.weight``;
* ``output_layer``: ``output_layer.weight`` (with tied embeddings it *is* the embedding);
* ``attention``: ``self_attention.linear_qkv`` / ``linear_proj`` of every layer;
* ``norms``: every RMSNorm weight (input, pre-MLP, per-head q / k, final);
* ``router``: ``mlp.router`` of every MoE layer;
* ``experts``: ``mlp.experts`` of every MoE layer;
* ``mlp``: ``mlp.linear_fc1`` / ``linear_fc2`` of a dense model.

Pure Python: config validation, the planner and the learner share it.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Set, Tuple

FREEZE_KEY = "optimizer.freeze"

FREEZE_GROUPS: Dict[str, str] = {
    "embedding": "the input embedding",
    "output_layer": "the output layer (the embedding itself when tied)",
    "attention": "QKV and output projections of every layer",
    "norms": "every RMSNorm weight (input, pre-MLP, q / k, final)",
    "router": "the MoE routers",
    "experts": "the MoE experts",
    "mlp": "the dense MLPs (dense models)",
}
"""Group name -> what it holds (in the order the error messages list them)."""

LAYER_GROUPS_MOE = ("attention", "norms", "router", "experts")
LAYER_GROUPS_DENSE = ("attention", "norms", "mlp")


def parameter_group(name: str) -> str:
    """The group of a Megatron-Core GPTModel parameter name (DDP's ``module.`` prefix allowed).

    Raises ValueError for a name no group knows (a model change this table must follow)."""
    if name.startswith("module."):
        name = name[len("module."):]
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("output_layer."):
        return "output_layer"
    if name.endswith("layernorm.weight") or name.endswith("layer_norm_weight") \
            or name.endswith("layernorm.bias") or name.endswith("layer_norm_bias"):
        return "norms"
    if ".self_attention." in name:
        return "attention"
    if ".mlp.router." in name:
        return "router"
    if ".mlp.experts." in name:
        return "experts"
    if ".mlp.linear_fc1." in name or ".mlp.linear_fc2." in name:
        return "mlp"
    raise ValueError(f"parameter '{name}' belongs to no {FREEZE_KEY} group "
                     f"({', '.join(FREEZE_GROUPS)})")


def stage_groups(model, num_stage_layers: int, first: bool, last: bool) -> Set[str]:
    """Groups with at least one parameter on a pipeline stage that holds ``num_stage_layers``
    transformer layers (``model``: a ModelConfig; tied embeddings on one stage have no
    separate output layer)."""
    groups: Set[str] = set()
    if num_stage_layers:
        groups |= set(LAYER_GROUPS_MOE if model.arch == "qwen3_moe" else LAYER_GROUPS_DENSE)
    if first:
        groups.add("embedding")
    if last:
        groups.add("norms")  # the final norm
        if not (model.tie_word_embeddings and first):
            groups.add("output_layer")
    return groups


def freeze_problems(model, freeze: Sequence[str], stage_layers: Sequence[int]) -> List[str]:
    """Why ``freeze`` cannot apply to ``model`` split into pipeline stages of ``stage_layers``
    transformer layers each (empty: it can). Each message starts with ``optimizer.freeze``."""
    freeze = list(freeze)
    problems: List[str] = []
    unknown = [g for g in freeze if g not in FREEZE_GROUPS]
    if unknown:
        problems.append(f"{FREEZE_KEY}: unknown group(s) {', '.join(map(repr, unknown))}; the "
                        f"groups are {', '.join(FREEZE_GROUPS)}")
    repeated = sorted({g for g in freeze if freeze.count(g) > 1})
    if repeated:
        problems.append(f"{FREEZE_KEY}: {', '.join(map(repr, repeated))} named more than once")
    if not freeze or unknown:
        return problems
    is_moe = model.arch == "qwen3_moe"
    absent = [g for g in freeze if (g in ("router", "experts") and not is_moe)
              or (g == "mlp" and is_moe)]
    if absent:
        problems.append(f"{FREEZE_KEY}: model.arch={model.arch} has no {' or '.join(absent)} "
                        f"parameters ({'dense' if not is_moe else 'MoE'} model)")
    if model.tie_word_embeddings and (("embedding" in freeze) != ("output_layer" in freeze)):
        problems.append(f"{FREEZE_KEY}: with model.tie_word_embeddings=true the output layer is "
                        "the embedding: freeze both 'embedding' and 'output_layer', or neither")
    frozen = set(freeze)
    for stage, layers in enumerate(stage_layers):
        present = stage_groups(model, layers, stage == 0, stage == len(stage_layers) - 1)
        if present <= frozen:
            where = "the model" if len(stage_layers) == 1 else f"pipeline stage {stage}"
            problems.append(f"{FREEZE_KEY}: {sorted(frozen)} freezes every parameter of {where} "
                            f"(its groups: {', '.join(sorted(present))}); nothing would train there")
    return problems


def frozen_set(freeze: Sequence[str]) -> Tuple[str, ...]:
    """The frozen groups in the canonical order (what checkpoints record)."""
    return tuple(g for g in FREEZE_GROUPS if g in set(freeze))

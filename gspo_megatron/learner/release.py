"""Let a learner's model, optimizer and process groups be freed when its run ends.

A process that trains more than once (the tests, a notebook, a sweep driver) would otherwise
keep every earlier model alive, and with it every gloo group the model holds: each a listening
socket, an epoll and two pipes: 72 descriptors left by each in-process ``gspo-train`` run
before this module and ``distributed/startup_gc.thaw_start_up`` (the other cause), so ~14 runs
reached the 1,024 a ``select()`` can watch.

What keeps a Megatron-Core 0.16.1 model alive past its last reference: DDP registers on each
parameter's gradient accumulator node a hook that closes over the DDP object
(megatron/core/distributed/distributed_data_parallel.py: ``grad_acc.register_hook(
self._make_backward_post_hook(param))``), so any tensor whose autograd graph reaches a parameter
reaches the whole model. Python's collector does not follow a tensor to its graph (that link is
in C++), so such a tensor held by the model or its optimizer is a cycle never collected. Three
of them, each shown necessary by ``tests/test_learner_release.py``:

- the distributed optimizer's fp32 shards, views taken with autograd on
  (megatron/core/optimizer/distrib_optimizer.py: ``shard_model_param =
  model_param.view(-1)[...]``, no ``detach`` in the fp32 branch), kept in its parameter groups,
  in the groups it first built (``opt_group_ranges[i]["orig_group"]``, which
  ``load_state_dict`` copied rather than reused) and in ``shard_fp32_groups``;
- the MoE token dispatchers' per-pass tensors (``MoEAllGatherTokenDispatcher.
  dispatch_postprocess``: ``self.local_probs``, never reset), whose graph reaches back through
  the router to every earlier parameter;
- and, graph or not, RoPE's cache: ``RotaryEmbedding.forward`` is an ``lru_cache`` on the class
  (megatron/core/models/common/embeddings/rotary_pos_embedding.py), keyed by the module itself,
  which holds the context-parallel group.

:func:`release_model` cuts each link. The model and optimizer do not train afterwards.
"""

from __future__ import annotations

from typing import List

import torch


def release_model(chunks: List[torch.nn.Module], optimizer) -> None:
    """Cut the links above for these chunks (DDP-wrapped or not) and this optimizer (or None).
    Safe to call twice."""
    for chunk in chunks:
        _drop_cached_graphs(chunk)
    if optimizer is not None:
        _drop_optimizer_tensors(optimizer)
    _forget_rope_cache()


def _drop_cached_graphs(chunk: torch.nn.Module) -> None:
    """Every non-leaf tensor attribute of a module, or of an object a module holds (the token
    dispatcher is an attribute, not a submodule)."""
    for module in chunk.modules():
        _drop_graph_attributes(module)
        for value in list(vars(module).values()):
            if not isinstance(value, torch.nn.Module) and hasattr(value, "__dict__"):
                _drop_graph_attributes(value)


def _drop_graph_attributes(holder) -> None:
    for name, value in list(vars(holder).items()):
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            setattr(holder, name, None)


def _drop_optimizer_tensors(optimizer) -> None:
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(part, "optimizer", None)
        if torch_optimizer is not None:
            torch_optimizer.state.clear()
            for group in torch_optimizer.param_groups:
                group["params"] = []
        for group_range in getattr(part, "opt_group_ranges", None) or []:
            group_range["orig_group"]["params"] = []
        for name in ("shard_fp32_groups", "shard_float16_groups", "shard_fp32_from_float16_groups"):
            for group in getattr(part, name, None) or []:
                group.clear()


def _forget_rope_cache() -> None:
    """Empty the class-wide cache: every model's RoPE tables are recomputed on their next use
    (one small table per sequence length), nothing else changes."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    cache_clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


__all__ = ["release_model"]

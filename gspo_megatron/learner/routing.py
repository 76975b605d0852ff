"""Record and replay MoE routing on Megatron-Core's own support, and compare two recordings.

Megatron-Core 0.16.1 (read in ``megatron/core/transformer/moe/router_replay.py``, ``router.py``
and ``moe_utils.py``): with ``TransformerConfig.moe_enable_routing_replay`` every ``TopKRouter``
owns a ``RouterReplay`` (``router.router_replay``), and ``topk_routing_with_score_function`` asks it
for the top-k. Its action decides:

- ``RECORD``: compute the top-k as usual and keep the indices (``recorded_topk_idx``,
  int64 ``[num_tokens, topk]``, overwritten by the next forward);
- ``REPLAY_FORWARD``: take ``target_topk_idx`` instead and gather the scores at those experts,
  so the routing weights and their gradient to the router still come from the current model;
- ``None``: compute as usual.

``num_tokens`` is the router's own token order: the layer input ``[s, b, h]`` flattened, so token
``(row b, column s)`` is index ``s * b_total + b``; under sequence parallelism each TP rank routes
only its ``s / tp`` slice. Megatron's fused router (``moe_router_fusion``) bypasses the replay, so
it is refused here.

What this module adds: the routers of *our* model chunks (Megatron's class-level
``global_router_replay_instances`` spans every model built in the process, a reference model
included), a :class:`RoutingTape` of one planned batch (``[chunk][micro-batch][layer]``, kept
on the CPU as int16 so that a rollout batch's routing does not occupy accelerator memory), a
:class:`RoutingSession` that the learner's forward step calls around each micro-batch, and
:func:`routing_change_metrics` for expert volatility.

Two sources of a tape: the learner's own old-policy pass (``RECORD``; R2, the paper's Routing
Replay) or the rollout engine (:func:`rollout_tape`; R3): each micro-batch then carries the
engine's routing laid out like its tokens (``MicroBatch.routing``), which is cut into the same
per-layer router token order, so R3 replays through exactly the R2 machinery.

Replay must see the micro-batches it recorded: the learner records and replays with the same
deterministic plan of the same (mini-)batch, and the tape's fingerprints refuse anything else.
``RouterReplay.set_target_indices`` also appends to ``replay_backward_list`` (for Megatron's
``REPLAY_BACKWARD``, which nothing in 0.16.1 sets); the session clears it after every pass.
Full activation recomputation re-runs the router in the backward pass with the *last* target
set, which is the right one only when each micro-batch's backward directly follows its forward
(no pipelining): pipeline parallelism plus ``recompute=full`` is refused.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

RECORD, REPLAY = "record", "replay"


def chunk_routers(chunk) -> list:
    """The ``RouterReplay`` objects of a model chunk's MoE layers, in layer order ([] if dense).

    Raises when the chunk has routers but was built without ``moe_enable_routing_replay``."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in chunk.modules() if isinstance(m, TopKRouter)]
    missing = [r for r in routers if getattr(r, "router_replay", None) is None]
    if missing:
        raise RuntimeError("the model's MoE routers have no RouterReplay: build it with "
                           "TransformerConfig.moe_enable_routing_replay=True (model/provider.py)")
    return [r.router_replay for r in routers]


def moe_routing_layout(model) -> Tuple[int, int, int]:
    """(layers, top-k, experts) of ``model`` (``model.*``, sizes from ``hf_path`` when set): what
    a rollout engine's routing must cover to be replayed here."""
    from gspo_megatron.model.provider import resolve_model_config

    resolved = resolve_model_config(model)
    return resolved.num_layers, resolved.moe_router_topk, resolved.num_experts


def chunk_router_layers(chunk) -> List[int]:
    """0-based global layer index of each MoE router of a chunk, in :func:`chunk_routers` order
    (Megatron's ``layer_number`` is 1-based and already counts the pipeline offset)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m.layer_number - 1 for m in chunk.modules() if isinstance(m, TopKRouter)]


def check_routing_supported(tf_config, routers: List[list], mode: str) -> None:
    """Refuse layouts in which Megatron would silently not record / replay (see module doc)."""
    if not any(routers):
        raise ValueError("MoE routing record / replay needs an MoE model (model.num_experts > 0)")
    if getattr(tf_config, "moe_router_fusion", False):
        raise ValueError("routing record / replay: Megatron's fused router (moe_router_fusion) "
                         "bypasses RouterReplay")
    if (mode == REPLAY and tf_config.recompute_granularity == "full"
            and tf_config.pipeline_model_parallel_size > 1):
        raise ValueError("routing replay with model.recompute=full needs parallel.pp=1: the "
                         "recomputed router would replay another micro-batch's experts")


def router_token_index(tokens_shape: Tuple[int, int], response_positions: torch.Tensor,
                       sp_size: int = 1, sp_rank: int = 0) -> torch.Tensor:
    """Router token indices (``s * rows + b``) of the response positions routed on this SP rank.

    ``tokens_shape`` is the micro-batch's local ``[rows, length]`` (a CP share under context
    parallelism); ``response_positions`` index it row-major. Under sequence parallelism rank
    ``sp_rank`` holds columns ``[sp_rank * length / sp, (sp_rank + 1) * length / sp)``."""
    rows, length = tokens_shape
    row, col = response_positions // length, response_positions % length
    if sp_size > 1:
        shard = length // sp_size
        mine = (col // shard) == sp_rank
        row, col = row[mine], col[mine] - sp_rank * shard
    return col * rows + row


@dataclass
class RoutingTape:
    """Top-k experts of every MoE layer for every micro-batch of one planned batch (this rank).

    ``indices[chunk][mb][layer]`` is int16 ``[num_router_tokens, topk]`` on the CPU;
    ``fingerprints[mb]`` identifies the micro-batch (sequence ids and shape), and
    ``response_index[mb]`` holds the router token indices of its response positions on this
    rank (see :func:`router_token_index`)."""

    indices: List[List[List[torch.Tensor]]]
    fingerprints: List[tuple] = field(default_factory=list)
    response_index: List[torch.Tensor] = field(default_factory=list)

    @property
    def num_micro_batches(self) -> int:
        return len(self.fingerprints)


def fingerprint(mb) -> tuple:
    """What must match between recording and replay: the tokens, their layout and sequences."""
    tokens = mb.tokens.detach().cpu().contiguous()
    return (tuple(mb.seq_ids), tuple(tokens.shape), mb.layout,
            zlib.crc32(tokens.numpy().tobytes()))


def rollout_tape(micro_batches: list, chunk_layers: List[List[int]], sp_size: int = 1,
                 sp_rank: int = 0) -> RoutingTape:
    """The rollout engine's routing (R3) of planned micro-batches, as a tape to replay.

    ``chunk_layers[c]``: global layer indices of chunk ``c``'s routers. Each micro-batch's
    ``routing`` [R, S, layers, top_k] becomes the router token order ``s * R + b`` (this SP
    rank's ``S / sp`` columns), one int16 ``[tokens, top_k]`` per router."""
    tape = RoutingTape(indices=[[] for _ in chunk_layers])
    for k, mb in enumerate(micro_batches):
        if mb.routing is None:
            raise RuntimeError(f"rollout routing replay: micro-batch {k} (sequences "
                               f"{list(mb.seq_ids)[:8]}) carries no routed experts from the engine")
        rows, length = mb.tokens.shape
        num_layers = mb.routing.shape[2]
        wanted = max((max(layers) for layers in chunk_layers if layers), default=-1)
        if wanted >= num_layers:
            raise RuntimeError(f"rollout routing replay: the engine's routing has {num_layers} "
                               f"layers, the learner's model routes layer {wanted}")
        flat = mb.routing.transpose(0, 1).reshape(length * rows, num_layers, -1)
        if sp_size > 1:
            shard = length // sp_size * rows
            flat = flat[sp_rank * shard:(sp_rank + 1) * shard]
        tape.fingerprints.append(fingerprint(mb))
        tape.response_index.append(router_token_index((rows, length), mb.response_positions,
                                                      sp_size, sp_rank))
        for c, layers in enumerate(chunk_layers):
            tape.indices[c].append([flat[:, layer].contiguous() for layer in layers])
    return tape


class RoutingSession:
    """One schedule run that records (``RECORD``) or replays (``REPLAY``) routing.

    Use as a context manager around Megatron's forward-backward call; the learner's forward step
    calls :meth:`before_forward` / :meth:`after_forward` around each micro-batch of each chunk.
    """

    def __init__(self, chunks: list, routers: List[list], mode: str, tape: Optional[RoutingTape] = None,
                 sp_size: int = 1, sp_rank: int = 0) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if mode not in (RECORD, REPLAY):
            raise ValueError(f"routing session mode {mode!r}; expected {RECORD!r} or {REPLAY!r}")
        if mode == REPLAY and tape is None:
            raise ValueError("routing replay needs the tape recorded by the old-policy pass")
        self.chunks, self.routers, self.mode = chunks, routers, mode
        self.sp_size, self.sp_rank = sp_size, sp_rank
        self.tape = tape if tape is not None else RoutingTape(indices=[[] for _ in chunks])
        self._action = RouterReplayAction.RECORD if mode == RECORD else RouterReplayAction.REPLAY_FORWARD
        self._next_mb = [0] * len(chunks)

    def _chunk_index(self, chunk) -> int:
        for i, c in enumerate(self.chunks):
            if c is chunk:
                return i
        raise RuntimeError("routing session: forward step on a chunk that is not the learner's")

    def __enter__(self) -> "RoutingSession":
        for routers in self.routers:
            for r in routers:
                r.clear_indices()
                r.set_router_replay_action(self._action)
        return self

    def __exit__(self, *exc) -> None:
        for routers in self.routers:
            for r in routers:
                r.clear_router_replay_action()
                r.clear_indices()  # also drops replay_backward_list, which grows per target

    def before_forward(self, chunk, mb) -> None:
        c = self._chunk_index(chunk)
        k = self._next_mb[c]
        if self.mode == RECORD:
            if c == 0:
                self.tape.fingerprints.append(fingerprint(mb))
                self.tape.response_index.append(router_token_index(
                    tuple(mb.tokens.shape), mb.response_positions, self.sp_size, self.sp_rank))
            return
        if k >= self.tape.num_micro_batches or self.tape.fingerprints[k] != fingerprint(mb):
            raise RuntimeError(
                f"routing replay: micro-batch {k} of this pass ({fingerprint(mb)[1]}, sequences "
                f"{list(mb.seq_ids)[:8]}) is not the one recorded; replay needs the same "
                "mini-batch and plan as the old-policy pass")
        recorded = self.tape.indices[c][k]
        if len(recorded) != len(self.routers[c]):
            raise RuntimeError(f"routing replay: {len(recorded)} recorded layers for "
                               f"{len(self.routers[c])} MoE layers in model chunk {c}")
        for router, idx in zip(self.routers[c], recorded):
            router.set_target_indices(idx.long())  # Megatron moves it to the scores' device

    def after_forward(self, chunk, mb) -> None:
        c = self._chunk_index(chunk)
        if self.mode == RECORD:
            layers = []
            for router in self.routers[c]:
                idx = router.get_recorded_indices()
                if idx is None:
                    raise RuntimeError("routing record: a MoE layer routed nothing (fused router?)")
                layers.append(idx.detach().to("cpu", torch.int16))
            self.tape.indices[c].append(layers)
        self._next_mb[c] += 1


def _expert_sets(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """bool ``[T, num_experts]``: the top-k set of every token."""
    out = torch.zeros(idx.shape[0], num_experts, dtype=torch.bool)
    return out.scatter_(1, idx.long(), True)


def routing_change_metrics(before: RoutingTape, after: RoutingTape,
                           num_experts: int) -> Dict[str, torch.Tensor]:
    """Expert volatility between two recordings of the same plan, as ``[sum, count]`` metrics.

    ``expert_set_changed_frac``: (response token, MoE layer) pairs whose top-k set differs;
    ``activated_expert_changed_frac``: activated experts (pair, slot) no longer activated
    (the paper's "~10% of the experts activated for the same rollout change")."""
    if before.fingerprints != after.fingerprints:
        raise ValueError("routing_change_metrics: the two tapes cover different micro-batches")
    changed_sets = torch.zeros(2, dtype=torch.float64)
    changed_experts = torch.zeros(2, dtype=torch.float64)
    for chunk_b, chunk_a in zip(before.indices, after.indices):
        for k, (layers_b, layers_a) in enumerate(zip(chunk_b, chunk_a)):
            where = before.response_index[k]
            for idx_b, idx_a in zip(layers_b, layers_a):
                set_b = _expert_sets(idx_b[where], num_experts)
                set_a = _expert_sets(idx_a[where], num_experts)
                gone = (set_b & ~set_a).sum(-1).double()
                topk = idx_b.shape[1]
                changed_sets += torch.stack([(gone > 0).double().sum(), gone.new_tensor(gone.numel())])
                changed_experts += torch.stack([gone.sum(), gone.new_tensor(gone.numel() * topk)])
    return {"expert_set_changed_frac": changed_sets,
            "activated_expert_changed_frac": changed_experts}

"""Memory of one SGLang rollout server GPU: weights per TP rank, the KV cache at
``mem_fraction_static``, and how many sequences of the configured length fit in it.

SGLang 0.5.23 sizes its KV pool after loading the weights
(``srt/mem_cache/kv_cache_configurator.py: _profile_available_bytes``): free memory minus the
non-static slack ``pre_model_load_memory * (1 - mem_fraction_static)``, i.e.
``f * M - weights`` with ``M`` the memory free before loading. One token costs
``layers * kv_heads_per_rank * (k_head_dim + v_head_dim) * kv_dtype_bytes``
(``srt/model_executor/pool_configurator.py: _compute_cell_size``), with
``kv_heads_per_rank = max(1, kv_heads // tp)`` (K/V heads are replicated when TP exceeds them).
Weights are bf16 and split over the server's TP ranks (experts over EP x TP, vocabulary-parallel
embedding and LM head); norms are replicated (negligible).
"""

from __future__ import annotations

from dataclasses import dataclass

from gspo_megatron.planner.hardware import Hardware
from gspo_megatron.planner.model_shape import ModelShape


@dataclass(frozen=True)
class RolloutEstimate:
    """Memory of one SGLang server GPU."""

    weights_bytes: float
    """Per GPU."""
    kv_cache_bytes: float
    """Per GPU: the KV pool SGLang allocates (may be <= 0: does not fit)."""
    kv_bytes_per_token: float
    """Per GPU."""
    max_tokens: int
    """Tokens the server's KV pool holds."""
    max_sequences: int
    """Sequences of ``seq_len`` tokens that fit at once."""
    seq_len: int

    @property
    def fits(self) -> bool:
        """At least one sequence fits the KV pool."""
        return self.max_sequences >= 1


def kv_bytes_per_token(shape: ModelShape, tp: int, kv_dtype_bytes: int = 2) -> float:
    """KV-cache bytes of one token on one GPU of a TP-``tp`` server."""
    kv_heads = max(1, shape.num_query_groups // tp)
    return shape.num_layers * kv_heads * 2 * shape.head_dim * kv_dtype_bytes


def rollout_server_weights(shape: ModelShape, tp: int) -> float:
    """bf16 bytes per GPU of a TP-``tp`` server, K/V projections replicated past their heads."""
    kv_replication = max(1, tp // shape.num_query_groups) if tp > shape.num_query_groups else 1
    kv_proj = shape.num_layers * 2 * shape.hidden_size * shape.num_query_groups * shape.head_dim
    extra_kv = kv_proj * (kv_replication - 1)
    return 2 * (shape.total_params() + extra_kv) / tp


def estimate_rollout(shape: ModelShape, tp: int, mem_fraction_static: float, seq_len: int,
                     hw: Hardware) -> RolloutEstimate:
    """Weights, KV pool and sequences of ``seq_len`` tokens for a TP-``tp`` server."""
    weights = rollout_server_weights(shape, tp)
    before_load = hw.gpu_memory_bytes - hw.reserved_bytes
    kv = mem_fraction_static * before_load - weights
    per_token = kv_bytes_per_token(shape, tp)
    max_tokens = max(0, int(kv // per_token))
    return RolloutEstimate(weights_bytes=weights, kv_cache_bytes=kv, kv_bytes_per_token=per_token,
                           max_tokens=max_tokens, max_sequences=max_tokens // max(seq_len, 1),
                           seq_len=seq_len)

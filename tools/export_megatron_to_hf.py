#!/usr/bin/env python
"""Thin wrapper of ``gspo_megatron.cli.export`` (same flags, see docs/checkpoints.md), runnable from a
checkout without installing: ``torchrun --nproc_per_node=N tools/export_megatron_to_hf.py --help``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gspo_megatron.cli.export import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

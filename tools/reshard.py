#!/usr/bin/env python
"""Thin wrapper of ``gspo_megatron.cli.reshard`` (same flags, see docs/checkpoints.md), runnable from a
checkout without installing: ``torchrun --nproc_per_node=N tools/reshard.py --help``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gspo_megatron.cli.reshard import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The GPU verification kit (``gspo_megatron.gpu_check``): one command, six checks, JSON + text.

    python tools/gpu_check.py --out DIR                 # one GPU; how to run it there: docs/gpu.md
    python tools/gpu_check.py --cpu-dry-run --out DIR   # the same code at tiny sizes on CPU (CI)

The library is imported inside ``main`` only: the kit spawns an engine process, which re-imports
this file, and that child must not pay for importing Megatron.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from gspo_megatron.gpu_check.runner import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())

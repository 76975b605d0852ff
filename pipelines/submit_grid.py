"""``python -m pipelines.submit_grid ARGS`` = ``gspo-grid submit ARGS`` (kept for existing scripts;
see ``gspo_megatron/cli/grid.py``)."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from gspo_megatron.cli.grid import main as grid_main


def main(argv: Optional[Sequence[str]] = None) -> int:
    return grid_main(["submit", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

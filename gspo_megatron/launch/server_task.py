"""One rollout server's Slurm step: exec this server's command from the plan.

    python -m gspo_megatron.launch.server_task <log dir>/launch_plan.json server<i>

slurm/fleet.sh starts one step per server (and starts it again after a death), running
slurm/rollout_server.sh with the server's name; the launch plan holds its full command line
(interpreter, port, devices, TP/DP/EP) and environment additions. The step must have landed on
the server's node (``SLURMD_NODENAME``): its address is that node's. The process becomes the
server (``execvp``), so Slurm's signals reach it directly.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

from gspo_megatron.launch.plan import server_for


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m gspo_megatron.launch.server_task PLAN.json SERVER_NAME", file=sys.stderr)
        return 2
    node = os.environ.get("SLURMD_NODENAME")
    if node is None:
        print("error: run me as a task of a Slurm step (SLURMD_NODENAME unset)", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        servers = json.load(f)["servers"]
    try:
        server = server_for(servers, args[1], node)
    except LookupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.environ.update(server.get("env") or {})
    os.execvp(server["argv"][0], server["argv"])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())

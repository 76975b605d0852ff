"""One rollout server task of the job's server step: exec this task's command from the plan.

    python -m gspo_megatron.launch.server_task <log dir>/launch_plan.json

slurm/rollout_server.sh runs it once per Slurm task; the node (``SLURMD_NODENAME``) and the
task's index on it (``SLURM_LOCALID``) pick the server, whose full command line (interpreter,
port, devices, TP/DP/EP) and environment additions the launch plan wrote. The process becomes
the server (``execvp``), so Slurm's signals reach it directly.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

from gspo_megatron.launch.plan import server_for


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m gspo_megatron.launch.server_task PLAN.json", file=sys.stderr)
        return 2
    node, local_id = os.environ.get("SLURMD_NODENAME"), os.environ.get("SLURM_LOCALID")
    if node is None or local_id is None:
        print("error: run me as a task of a Slurm step (SLURMD_NODENAME / SLURM_LOCALID unset)",
              file=sys.stderr)
        return 2
    with open(args[0]) as f:
        servers = json.load(f)["servers"]
    try:
        server = server_for(servers, node, int(local_id))
    except LookupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.environ.update(server.get("env") or {})
    os.execvp(server["argv"][0], server["argv"])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())

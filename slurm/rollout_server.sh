#!/usr/bin/env bash
# One rollout server, the one task of its own Slurm step (started, and restarted after a death,
# by slurm/fleet.sh): `rollout_server.sh server<i>`. The launch plan ($GSPO_LAUNCH_PLAN, written
# by python -m gspo_megatron.launch) holds every server's command line, derived from
# rollout.sglang; this task becomes the named server, run by the job's one interpreter
# ($GSPO_PYTHON). Not meant to be submitted by itself.
set -euo pipefail
exec "${GSPO_PYTHON:?}" -m gspo_megatron.launch.server_task "${GSPO_LAUNCH_PLAN:?}" "${1:?usage: rollout_server.sh SERVER_NAME}"

#!/usr/bin/env bash
# One rollout server per Slurm task of the job's server step (started by slurm/train_job.sh with
# one task per server). The launch plan ($GSPO_LAUNCH_PLAN, written by python -m
# gspo_megatron.launch) holds every server's command line, derived from rollout.sglang; this task
# becomes the server of its node and local id, run by the job's one interpreter ($GSPO_PYTHON).
# Not meant to be submitted by itself.
set -euo pipefail
exec "${GSPO_PYTHON:?}" -m gspo_megatron.launch.server_task "${GSPO_LAUNCH_PLAN:?}"

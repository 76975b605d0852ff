#!/usr/bin/env bash
# CPU profile of slurm/gspo_30b.sh: the tiny config on CPU nodes, reference rollout servers (the
# HTTP stand-in for SGLang) next to one-process learners. Same code path, no GPUs.
#
#   sbatch slurm/tiny_cpu.sh [config.overrides ...]
#   two nodes, learner on one and the server on the other:
#   sbatch --nodes=2 slurm/tiny_cpu.sh rollout.mode=disaggregated launch.num_learner_nodes=1
#   in-process engine, no servers:
#   sbatch slurm/tiny_cpu.sh rollout.engine=embedded rollout.weight_sync.transport=auto
#   slurm/tiny_cpu.sh --dry-run --nodelist node1 [overrides]
#
# Settings as in slurm/gspo_30b.sh. The CPU profile starts from these overrides (yours come after
# them and win): launch.devices_per_node=1 (one learner process and one server per node),
# rollout.engine=reference, rollout.weight_sync.transport=nccl (gloo between processes),
# rollout.sglang.port=31000, launch.warning_lead_s=60 (its --signal=B:USR1@60). GSPO_CONFIG
# defaults to configs/tiny_cpu.yaml, GSPO_PYTHON to python3. GSPO_TRAIN_ENTRY /
# GSPO_ROLLOUT_ENTRY replace the python entry points (tests use stand-ins).
#SBATCH --job-name=gspo-tiny-cpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=01:00:00
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

GSPO_REPO=${GSPO_REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}
GSPO_SCRIPT=slurm/tiny_cpu.sh
GSPO_JOB_NAME=gspo-tiny-cpu
GSPO_PROFILE=cpu
GSPO_PROFILE_OVERRIDES=(launch.devices_per_node=1 rollout.engine=reference
  rollout.weight_sync.transport=nccl rollout.sglang.port=31000 launch.warning_lead_s=60)
GSPO_CONFIG=${GSPO_CONFIG:-configs/tiny_cpu.yaml}
GSPO_PYTHON=${GSPO_PYTHON:-python3}
export GSPO_REPO GSPO_PROFILE GSPO_PYTHON
cd "$GSPO_REPO"
# shellcheck source=slurm/lib.sh
source "$GSPO_REPO/slurm/lib.sh"
# shellcheck source=slurm/train_job.sh
source "$GSPO_REPO/slurm/train_job.sh"
gspo_train_main "$@"

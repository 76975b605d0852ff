#!/usr/bin/env bash
# CPU profile of slurm/gspo_30b.sh: the tiny config on one CPU node, the reference rollout
# server (HTTP stand-in for SGLang) next to a one-process learner. Same code path, no GPUs.
#
#   sbatch slurm/tiny_cpu.sh [config.overrides ...]
#   two nodes, learner on one and the server on the other:
#   sbatch --nodes=2 --export=ALL,GSPO_MODE=disaggregated,GSPO_NUM_LEARNER_NODES=1 slurm/tiny_cpu.sh
#
# Settings as in slurm/gspo_30b.sh, with these defaults: GSPO_CONFIG=configs/tiny_cpu.yaml,
# GSPO_MODE=colocated, GSPO_PROCS_PER_NODE=1, GSPO_SERVERS_PER_NODE=1, GSPO_SERVER_PORT=31000,
# GSPO_PYTHON=python3. GSPO_HF_DIR (the model the server loads first) must be set when
# GSPO_SERVERS_PER_NODE > 0; set GSPO_SERVERS_PER_NODE=0 for the in-process embedded engine.
# GSPO_TRAIN_ENTRY / GSPO_ROLLOUT_ENTRY replace the python entry points (tests use stand-ins).
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
GSPO_PROFILE=cpu
GSPO_CONFIG=${GSPO_CONFIG:-configs/tiny_cpu.yaml}
GSPO_MODE=${GSPO_MODE:-colocated}
GSPO_PROCS_PER_NODE=${GSPO_PROCS_PER_NODE:-1}
GSPO_SERVERS_PER_NODE=${GSPO_SERVERS_PER_NODE:-1}
GSPO_SERVER_PORT=${GSPO_SERVER_PORT:-31000}
GSPO_PYTHON=${GSPO_PYTHON:-python3}
export GSPO_REPO GSPO_PROFILE GSPO_PYTHON
cd "$GSPO_REPO"
# shellcheck source=slurm/lib.sh
source "$GSPO_REPO/slurm/lib.sh"
# shellcheck source=slurm/train_job.sh
source "$GSPO_REPO/slurm/train_job.sh"
gspo_train_main "$@"

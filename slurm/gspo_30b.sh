#!/usr/bin/env bash
# GSPO post-training of Qwen3-30B-A3B on H100 nodes: SGLang rollout servers + Megatron learners.
#
#   cd /path/to/gspo-megatron && sbatch slurm/gspo_30b.sh [config.overrides ...]
#   e.g. sbatch --nodes=8 --export=ALL,GSPO_NUM_LEARNER_NODES=4 slurm/gspo_30b.sh trainer.num_steps=200
#
# Arguments are dot-list config overrides handed to the trainer. Settings come from the
# environment (sbatch exports it); defaults match configs/qwen3_30b_a3b_gspo.yaml:
#   GSPO_CONFIG               configs/qwen3_30b_a3b_gspo.yaml
#   GSPO_MODE                 disaggregated | colocated (colocated: every node learns and serves)
#   GSPO_NUM_LEARNER_NODES    2   (disaggregated; the first N nodes of the job)
#   GSPO_NUM_ROLLOUT_NODES    rest of the job's nodes
#   GSPO_PROCS_PER_NODE       8   learner processes (GPUs) per node
#   GSPO_SERVERS_PER_NODE     2   SGLang servers per rollout node (0: no servers)
#   GSPO_SGLANG_TP            4   GPUs per server; server i uses GPUs [i*TP, (i+1)*TP)
#   GSPO_SERVER_PORT          30000 (server i listens on PORT+i)
#   GSPO_HF_DIR               /models/Qwen3-30B-A3B (model.hf_path; what the servers load first)
#   GSPO_LOAD_DIR             converted Megatron checkpoint for the initial weights (optional)
#   GSPO_RUN_DIR              runs/<job name>-<job id>; logs in <run dir>/logs/<job id>/
#   GSPO_CONTAINER_IMAGE      pyxis image (e.g. a squashfs of the Dockerfile's gpu target)
#   GSPO_CONTAINER_MOUNTS     default: the repo and the run dir at the same paths
#   GSPO_PYTHON / GSPO_SGLANG_PYTHON  python / /opt/sglang/bin/python (the image's two envs)
#   GSPO_REPO                 repository root (default: the submit directory)
#   NCCL_* / TORCH_NCCL_*     already-set values win over the defaults in slurm/lib.sh
# The script sets logging.run_dir, parallel.world_size, rollout.mode, model.hf_path,
# checkpoint.load_dir and rollout.sglang.server_addresses itself (after the arguments), and
# exports GSPO_WEIGHT_SYNC_ADDR (learner rank 0's node, where the weight-sync group meets).
# Preemption: Slurm sends USR1 10 minutes before the limit; the learner checkpoints and exits
# 124, and the job requeues itself and resumes from that checkpoint.
#SBATCH --job-name=gspo-30b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

GSPO_REPO=${GSPO_REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}
GSPO_PROFILE=gpu
GSPO_CONFIG=${GSPO_CONFIG:-configs/qwen3_30b_a3b_gspo.yaml}
GSPO_MODE=${GSPO_MODE:-disaggregated}
GSPO_NUM_LEARNER_NODES=${GSPO_NUM_LEARNER_NODES:-2}
GSPO_PROCS_PER_NODE=${GSPO_PROCS_PER_NODE:-8}
GSPO_SERVERS_PER_NODE=${GSPO_SERVERS_PER_NODE:-2}
GSPO_SGLANG_TP=${GSPO_SGLANG_TP:-4}
GSPO_SERVER_PORT=${GSPO_SERVER_PORT:-30000}
GSPO_HF_DIR=${GSPO_HF_DIR:-/models/Qwen3-30B-A3B}
GSPO_PYTHON=${GSPO_PYTHON:-python}
GSPO_SGLANG_PYTHON=${GSPO_SGLANG_PYTHON:-/opt/sglang/bin/python}
export GSPO_REPO GSPO_PROFILE GSPO_SGLANG_TP GSPO_PYTHON GSPO_SGLANG_PYTHON
cd "$GSPO_REPO"
# shellcheck source=slurm/lib.sh
source "$GSPO_REPO/slurm/lib.sh"
# shellcheck source=slurm/train_job.sh
source "$GSPO_REPO/slurm/train_job.sh"
gspo_train_main "$@"

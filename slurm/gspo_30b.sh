#!/usr/bin/env bash
# GSPO post-training of Qwen3-30B-A3B on H100 nodes: SGLang rollout servers + Megatron learners.
#
#   cd /path/to/gspo-megatron && sbatch slurm/gspo_30b.sh [config.overrides ...]
#   e.g. sbatch --nodes=8 slurm/gspo_30b.sh launch.num_learner_nodes=4 rollout.sglang.num_servers=8
#   slurm/gspo_30b.sh --dry-run --nodelist 'node[01-04]' [overrides]   # print every step, run none
#
# The layout is the config's (configs/qwen3_30b_a3b_gspo.yaml): launch.num_learner_nodes learn,
# the job's other nodes serve, rollout.mode (disaggregated | colocated), rollout.sglang.{num_servers,
# tp, dp, ep, port}; the job refuses, before starting anything, a fleet that does not fill its
# nodes (config/allocation.py). Arguments are dot-list config overrides. Environment:
#   GSPO_CONFIG               configs/qwen3_30b_a3b_gspo.yaml
#   GSPO_HF_DIR / GSPO_LOAD_DIR / GSPO_RUN_DIR   override model.hf_path / checkpoint.load_dir /
#                             logging.run_dir (default runs/<job name>-<job id>; logs in
#                             <run dir>/logs/<job id>/)
#   GSPO_CONTAINER_IMAGE      pyxis image (a squashfs of the Dockerfile's gpu target)
#   GSPO_CONTAINER_MOUNTS     extra mounts SRC[:DST[:FLAGS]],... added to those derived from the
#                             config's paths (repo, run dir, model, data, checkpoints)
#   GSPO_PYTHON               python: the image's one interpreter, for learners and servers alike
#   GSPO_SGLANG_EXTRA_ARGS    extra SGLang flags (not TP/DP/EP/port/model: the config's)
#   GSPO_REPO                 repository root (default: the submit directory)
#   NCCL_* / TORCH_NCCL_*     already-set values win over the defaults in slurm/lib.sh
# The trainer gets logging.run_dir, launch.num_nodes, rollout.sglang.server_addresses (and
# parallel.world_size when the config leaves it open) after the arguments; learner rank 0
# publishes its own address for the weight-update group. Preemption: Slurm sends USR1 15 minutes
# before the limit (launch.warning_lead_s: a step of ~8 min and a save of ~2 min fit, gspo-plan); the learner checkpoints (the step it is in, or the last completed one when
# the job's end leaves no room for the step and a save) and exits 124, and the job requeues
# itself and resumes from that checkpoint (docs/cluster.md).
#SBATCH --job-name=gspo-30b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

GSPO_REPO=${GSPO_REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}
GSPO_SCRIPT=slurm/gspo_30b.sh
GSPO_JOB_NAME=gspo-30b
GSPO_PROFILE=gpu
GSPO_PROFILE_OVERRIDES=()
GSPO_CONFIG=${GSPO_CONFIG:-configs/qwen3_30b_a3b_gspo.yaml}
GSPO_PYTHON=${GSPO_PYTHON:-python}
export GSPO_REPO GSPO_PROFILE GSPO_PYTHON
cd "$GSPO_REPO"
# shellcheck source=slurm/lib.sh
source "$GSPO_REPO/slurm/lib.sh"
# shellcheck source=slurm/train_job.sh
source "$GSPO_REPO/slurm/train_job.sh"
gspo_train_main "$@"

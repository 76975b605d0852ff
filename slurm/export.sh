#!/usr/bin/env bash
# Export a Megatron checkpoint of a run (the final one, or a chosen one) to Hugging Face format.
#
#   sbatch --export=ALL,GSPO_RUN_DIR=runs/my-run slurm/export.sh
#
#   GSPO_RUN_DIR            the training run (required unless GSPO_EXPORT_CHECKPOINT is set)
#   GSPO_EXPORT_CHECKPOINT  checkpoint to export (default <run dir>/checkpoints, its latest)
#   GSPO_EXPORT_DIR         output (default <run dir>/hf_export)
#   GSPO_PYTHON, GSPO_CONTAINER_IMAGE, GSPO_CONTAINER_MOUNTS, GSPO_REPO as in slurm/gspo_30b.sh
#                           (the container mounts the repo, run dir, checkpoint and output)
#   GSPO_EXPORT_ENTRY       python entry (default "-m gspo_megatron.cli.export")
# Extra arguments are passed to the exporter unchanged.
#SBATCH --job-name=gspo-export
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

GSPO_REPO=${GSPO_REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}
GSPO_PYTHON=${GSPO_PYTHON:-python}
export GSPO_REPO
cd "$GSPO_REPO"
# shellcheck source=slurm/lib.sh
source "$GSPO_REPO/slurm/lib.sh"
gspo_require_slurm
gspo_setup_run_dir
checkpoint=${GSPO_EXPORT_CHECKPOINT:-$GSPO_RUN_DIR/checkpoints}
[[ -e $checkpoint ]] || gspo_fail 2 "checkpoint to export not found: $checkpoint"
read -r -a entry <<<"${GSPO_EXPORT_ENTRY:--m gspo_megatron.cli.export}"
GSPO_EXTRA_MOUNT_PATHS=("$checkpoint" "${GSPO_EXPORT_DIR:-$GSPO_RUN_DIR/hf_export}")
gspo_single_step_main export "$GSPO_PYTHON" "${entry[@]}" --ckpt "$checkpoint" \
  --out "${GSPO_EXPORT_DIR:-$GSPO_RUN_DIR/hf_export}" --overwrite "$@"

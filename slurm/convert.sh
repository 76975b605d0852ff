#!/usr/bin/env bash
# Convert a Hugging Face checkpoint to a Megatron checkpoint in the training layout.
#
#   sbatch --export=ALL,GSPO_HF_DIR=/models/Qwen3-30B-A3B slurm/convert.sh [config.overrides ...]
#
#   GSPO_HF_DIR        the Hugging Face model directory (required)
#   GSPO_CONVERTED_DIR output (default <run dir>/converted)
#   GSPO_RUN_DIR, GSPO_PYTHON, GSPO_CONTAINER_IMAGE, GSPO_CONTAINER_MOUNTS, GSPO_REPO as in
#                      slurm/gspo_30b.sh (the container mounts the repo, run dir, model and output)
#   GSPO_CONVERT_ENTRY python entry (default "-m gspo_megatron.cli.convert")
#   GSPO_CONVERT_ARGS  extra converter flags, e.g. "--ep 8" with --ntasks=8 to split the host
#                      memory over 8 processes (the checkpoint loads under any training layout)
# Config overrides given on the command line do not change a conversion and are ignored here.
#SBATCH --job-name=gspo-convert
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
[[ -n ${GSPO_HF_DIR:-} ]] || gspo_fail 2 "GSPO_HF_DIR (the Hugging Face model to convert) is not set"
read -r -a entry <<<"${GSPO_CONVERT_ENTRY:--m gspo_megatron.cli.convert}"
read -r -a extra <<<"${GSPO_CONVERT_ARGS:-}"
GSPO_EXTRA_MOUNT_PATHS=("$GSPO_HF_DIR" "${GSPO_CONVERTED_DIR:-$GSPO_RUN_DIR/converted}")
gspo_single_step_main convert "$GSPO_PYTHON" "${entry[@]}" --hf-dir "$GSPO_HF_DIR" \
  --out "${GSPO_CONVERTED_DIR:-$GSPO_RUN_DIR/converted}" --overwrite "${extra[@]}"

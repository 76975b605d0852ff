#!/usr/bin/env bash
# One rollout server per Slurm task, started by slurm/lib.sh (gspo_start_rollout_servers) with
# --ntasks-per-node=GSPO_SERVERS_PER_NODE: task i of a node listens on GSPO_SERVER_PORT + i and,
# on GPUs, owns GPUs [i*GSPO_SGLANG_TP, (i+1)*GSPO_SGLANG_TP). The CPU profile runs the
# reference server instead of SGLang. Not meant to be submitted by itself.
set -euo pipefail

index=${SLURM_LOCALID:?run me through srun}
port=$((GSPO_SERVER_PORT + index))

if [[ ${GSPO_PROFILE:-gpu} == cpu ]]; then
  read -r -a entry <<<"${GSPO_ROLLOUT_ENTRY:--m gspo_megatron.rollout.reference_server}"
  exec "$GSPO_PYTHON" "${entry[@]}" --model-path "$GSPO_HF_DIR" --host 0.0.0.0 --port "$port"
fi

tp=${GSPO_SGLANG_TP:?}
CUDA_VISIBLE_DEVICES=$(seq -s, $((index * tp)) $((index * tp + tp - 1)))
export CUDA_VISIBLE_DEVICES
read -r -a extra <<<"${GSPO_SGLANG_EXTRA_ARGS:-}"
exec "${GSPO_SGLANG_PYTHON:-python}" -m sglang.launch_server \
  --model-path "$GSPO_HF_DIR" --tp-size "$tp" --host 0.0.0.0 --port "$port" \
  --mem-fraction-static "${GSPO_SGLANG_MEM_FRACTION:-0.8}" "${extra[@]}"

# shellcheck shell=bash
# The training job of slurm/gspo_30b.sh (GPU) and slurm/tiny_cpu.sh (CPU profile): split the
# nodes, start the rollout servers and wait for their health, start the learners with srun +
# torchrun (rendezvous on the first learner node), hand the trainer the server addresses and
# the weight-sync address, then supervise (slurm/lib.sh, which this file needs sourced first).

# Start GSPO_SERVERS_PER_NODE servers on every rollout node, wait for /health, and set
# GSPO_SERVER_ADDRESSES (host:port list) for the trainer.
gspo_start_rollout_servers() {
  local per_node=$1 node addr i urls=()
  GSPO_SERVER_ADDRESSES=()
  ((per_node > 0)) || return 0
  [[ -n ${GSPO_HF_DIR:-} ]] || gspo_fail 2 "GSPO_HF_DIR (the model the rollout servers load) is not set"
  for node in "${GSPO_ROLLOUT_NODES[@]}"; do
    addr=$(gspo_node_addr "$node")
    for ((i = 0; i < per_node; i++)); do
      GSPO_SERVER_ADDRESSES+=("${addr}:$((GSPO_SERVER_PORT + i))")
      urls+=("http://${addr}:$((GSPO_SERVER_PORT + i))/health")
    done
  done
  export GSPO_SERVER_PORT GSPO_HF_DIR
  gspo_start_step service rollout --nodes="${#GSPO_ROLLOUT_NODES[@]}" \
    --ntasks="$((${#GSPO_ROLLOUT_NODES[@]} * per_node))" --ntasks-per-node="$per_node" \
    --cpus-per-task="$(gspo_cpus_per_task "$per_node")" \
    --nodelist="$(gspo_join , "${GSPO_ROLLOUT_NODES[@]}")" -- bash "$GSPO_REPO/slurm/rollout_server.sh"
  gspo_wait_healthy "${GSPO_HEALTH_TIMEOUT_S:-900}" "${urls[@]}"
}

# Entry point of slurm/gspo_30b.sh and slurm/tiny_cpu.sh: servers, then learners, then supervise.
# Arguments are config overrides (dot-list) for the trainer.
gspo_train_main() {
  local head port world nproc entry derived=()
  gspo_require_slurm
  gspo_setup_run_dir
  gspo_install_traps
  gspo_grid_overrides
  [[ $GSPO_PROFILE == gpu || $GSPO_PROFILE == cpu ]] || gspo_fail 2 "GSPO_PROFILE must be gpu or cpu, got '$GSPO_PROFILE'"
  [[ -r $GSPO_CONFIG ]] || gspo_fail 2 "config file not found: $GSPO_CONFIG"
  gspo_export_runtime_env
  gspo_split_nodes "${GSPO_MODE:?}" "${GSPO_NUM_LEARNER_NODES:-}" "${GSPO_NUM_ROLLOUT_NODES:-}"
  gspo_start_rollout_servers "${GSPO_SERVERS_PER_NODE:-0}"

  head=$(gspo_node_addr "${GSPO_LEARNER_NODES[0]}")
  port=${GSPO_RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
  # Learner rank 0 opens the weight-sync group with the servers at this address (its port is
  # picked free by the trainer).
  export GSPO_WEIGHT_SYNC_ADDR=$head
  nproc=${GSPO_PROCS_PER_NODE:?GSPO_PROCS_PER_NODE is not set}
  world=$((${#GSPO_LEARNER_NODES[@]} * nproc))
  derived=("logging.run_dir=${GSPO_RUN_DIR}" "parallel.world_size=${world}" "rollout.mode=${GSPO_MODE}")
  if ((${#GSPO_SERVER_ADDRESSES[@]})); then
    derived+=("rollout.sglang.server_addresses=[$(gspo_join , "${GSPO_SERVER_ADDRESSES[@]}")]")
    # A CPU server is another process even on the learner's node: no CUDA IPC, so weights go
    # over the broadcast group (gloo on CPU) in both placements.
    if [[ $GSPO_PROFILE == cpu ]]; then
      derived+=("rollout.engine=reference" "rollout.weight_sync.transport=nccl")
    fi
  fi
  if [[ -n ${GSPO_HF_DIR:-} ]]; then derived+=("model.hf_path=${GSPO_HF_DIR}"); fi
  if [[ -n ${GSPO_LOAD_DIR:-} ]]; then derived+=("checkpoint.load_dir=${GSPO_LOAD_DIR}"); fi
  if ((GSPO_PREEMPTED == 1)); then
    # The warning came while the servers started: nothing to save yet, come back later.
    gspo_stop_steps
    gspo_requeue "SIGUSR1 before the learner started"
  fi
  read -r -a entry <<<"${GSPO_TRAIN_ENTRY:--m gspo_megatron.cli.train}"
  # torchrun dies on SIGUSR1 by default; it ignores it here (the ignore is inherited), and the
  # trainer installs its own handler, so a forwarded USR1 reaches exactly the training ranks.
  gspo_start_step main learner --nodes="${#GSPO_LEARNER_NODES[@]}" \
    --ntasks="${#GSPO_LEARNER_NODES[@]}" --ntasks-per-node=1 --cpus-per-task="$(gspo_cpus_per_task 1)" \
    --nodelist="$(gspo_join , "${GSPO_LEARNER_NODES[@]}")" -- \
    bash -c 'trap "" USR1; exec "$@"' gspo-learner \
    "$GSPO_PYTHON" -m torch.distributed.run --nnodes="${#GSPO_LEARNER_NODES[@]}" \
    --nproc-per-node="$nproc" --rdzv-backend=c10d --rdzv-endpoint="${head}:${port}" \
    --rdzv-id="${SLURM_JOB_ID}-r${GSPO_RESTART}" --max-restarts=0 \
    "${entry[@]}" "$GSPO_CONFIG" "$@" "${GSPO_GRID_OVERRIDES[@]}" "${derived[@]}"
  gspo_supervise
}

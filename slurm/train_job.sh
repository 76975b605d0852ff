# shellcheck shell=bash
# The training job of slurm/gspo_30b.sh (GPU) and slurm/tiny_cpu.sh (CPU profile). The shell
# gathers the allocation (node names and Slurm NodeAddrs) and hands it, with the config and the
# overrides, to `python -m gspo_megatron.launch`, which validates the config against the
# allocation and writes the launch plan: which nodes learn and serve, every server's command
# line (TP/DP/EP, port, devices: from rollout.sglang, the same values the trainer sizes the
# weight-update group with), the torchrun command and the container mounts. The shell then
# starts the servers, waits for their health, starts the learners and supervises
# (slurm/lib.sh, which this file needs sourced first). `--dry-run` prints all of it instead.

# shellcheck source=slurm/fleet.sh
source "$GSPO_REPO/slurm/fleet.sh"

# Settings that used to be environment variables; the config now holds each (one source).
# shellcheck disable=SC2153  # the keys are names, not variables read here
readonly -A GSPO_RETIRED_SETTINGS=(
  [GSPO_MODE]="rollout.mode"
  [GSPO_NUM_LEARNER_NODES]="launch.num_learner_nodes"
  [GSPO_NUM_ROLLOUT_NODES]="launch.num_nodes - launch.num_learner_nodes (the job's other nodes)"
  [GSPO_PROCS_PER_NODE]="launch.devices_per_node"
  [GSPO_SERVERS_PER_NODE]="rollout.sglang.num_servers, tp, dp (rollout.engine=embedded: none)"
  [GSPO_SGLANG_TP]="rollout.sglang.tp"
  [GSPO_SERVER_PORT]="rollout.sglang.port"
  [GSPO_SGLANG_MEM_FRACTION]="rollout.sglang.mem_fraction_static"
  [GSPO_HEALTH_TIMEOUT_S]="rollout.sglang.health_timeout_s"
  [GSPO_SGLANG_PYTHON]="GSPO_PYTHON (learners and servers share one interpreter)"
  [GSPO_WEIGHT_SYNC_ADDR]="nothing: learner rank 0 publishes its own address"
)

gspo_refuse_retired_settings() {
  local name
  for name in "${!GSPO_RETIRED_SETTINGS[@]}"; do
    if [[ -n ${!name:-} ]]; then
      gspo_fail 2 "$name is no longer read; set ${GSPO_RETIRED_SETTINGS[$name]} instead"
    fi
  done
}

# --node NAME=ADDR for every node of the job, in Slurm's order (a dry run may pass a host list).
gspo_node_args() {
  local node
  GSPO_NODE_ARGS=()
  if [[ -n ${GSPO_DRY_NODELIST:-} ]]; then
    GSPO_NODE_ARGS=(--nodelist "$GSPO_DRY_NODELIST")
    return 0
  fi
  [[ -n ${SLURM_JOB_NODELIST:-} ]] || gspo_fail 2 "no allocation: SLURM_JOB_NODELIST is unset (a dry run takes --nodelist)"
  mapfile -t GSPO_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  for node in "${GSPO_NODES[@]}"; do GSPO_NODE_ARGS+=(--node "${node}=$(gspo_node_addr "$node")"); done
}

# Run the planner (in the container when there is one: it needs the image's Python) and source
# the plan. Arguments: config overrides.
gspo_launch_plan() {
  local derived=("logging.run_dir=${GSPO_RUN_DIR}") args cmd out rc=0
  if [[ -n ${GSPO_HF_DIR:-} ]]; then derived+=("model.hf_path=${GSPO_HF_DIR}"); fi
  if [[ -n ${GSPO_LOAD_DIR:-} ]]; then derived+=("checkpoint.load_dir=${GSPO_LOAD_DIR}"); fi
  gspo_node_args
  GSPO_LAUNCH_PLAN="${GSPO_PLAN_DIR}/launch_plan.r${GSPO_RESTART}.json"
  args=(--config "$GSPO_CONFIG" --repo "$GSPO_REPO" --python "$GSPO_PYTHON" --job-id "${SLURM_JOB_ID}"
    --restart "$GSPO_RESTART" --cpus-per-node "${SLURM_CPUS_ON_NODE:-1}" "${GSPO_NODE_ARGS[@]}"
    --train-entry "${GSPO_TRAIN_ENTRY:--m gspo_megatron.cli.train}" --rollout-entry "${GSPO_ROLLOUT_ENTRY:-}"
    --sglang-extra-args "${GSPO_SGLANG_EXTRA_ARGS:-}" --user-mounts "${GSPO_CONTAINER_MOUNTS:-}"
    --out-sh "${GSPO_PLAN_DIR}/launch_plan.r${GSPO_RESTART}.sh" --out-json "$GSPO_LAUNCH_PLAN")
  if [[ $GSPO_PROFILE == gpu && -n ${SLURM_GPUS_ON_NODE:-} ]]; then args+=(--devices-on-node "$SLURM_GPUS_ON_NODE"); fi
  if [[ -n ${GSPO_RDZV_PORT:-} ]]; then args+=(--rdzv-port "$GSPO_RDZV_PORT"); fi
  # the servers' keys (a 0600 file in the run directory; its path is all a command line shows)
  if ! ((${GSPO_DRY_RUN:-0})); then args+=(--make-keys); fi
  cmd=("$GSPO_PYTHON" -m gspo_megatron.launch "${args[@]}" -- "$@" "${derived[@]}")
  gspo_container_args
  if ((${#GSPO_CONTAINER_ARGS[@]})); then
    cmd=(srun --overlap --nodes=1 --ntasks=1 --job-name=plan --nodelist="${SLURMD_NODENAME:-$(hostname)}"
      "${GSPO_CONTAINER_ARGS[@]}" "${cmd[@]}")
  fi
  if ((${GSPO_DRY_RUN:-0})); then
    printf '# the launch plan (%s):\n' "$GSPO_LAUNCH_PLAN"
    gspo_print_command "${cmd[@]}"
    cmd=("$GSPO_PYTHON" -m gspo_megatron.launch "${args[@]}" -- "$@" "${derived[@]}")
  fi
  out=$("${cmd[@]}" 2>&1) || rc=$?
  if ((rc != 0)); then
    gspo_fail "$((rc == 2 ? 2 : 1))" "the launch plan refused the job (config $GSPO_CONFIG):
$out"
  fi
  # shellcheck source=/dev/null
  source "${GSPO_PLAN_DIR}/launch_plan.r${GSPO_RESTART}.sh"
  export GSPO_LAUNCH_PLAN
}

# Every container mount source exists on this node (pyxis would fail each step less clearly).
gspo_check_mounts() {
  local i
  [[ -n ${GSPO_CONTAINER_IMAGE:-} ]] && ! ((${GSPO_DRY_RUN:-0})) || return 0
  for i in "${!GSPO_MOUNT_SOURCES[@]}"; do
    [[ -e ${GSPO_MOUNT_SOURCES[$i]} ]] || gspo_fail 2 "container mount ${GSPO_MOUNT_SOURCES[$i]} \
(${GSPO_MOUNT_ORIGINS[$i]}) does not exist on $(hostname)"
  done
}

gspo_print_dry_run_header() {
  local name
  printf '# dry run of %s: job %s on %s; nothing is started\n' "$GSPO_SCRIPT" "$SLURM_JOB_ID" \
    "${GSPO_DRY_NODELIST:-${SLURM_JOB_NODELIST:-?}}"
  printf '# environment of every step:\n'
  while read -r name; do
    printf 'export %s=%q\n' "$name" "${!name}"
  done < <(compgen -e | grep -E '^(CUDA_|NCCL_|TORCH_NCCL_|GLOO_|OMP_|PYTHONUNBUFFERED$|GSPO_)' | sort)
}

# Entry point of slurm/gspo_30b.sh and slurm/tiny_cpu.sh. Arguments: [--dry-run [--nodelist
# LIST]] then config overrides (dot-list) for the trainer.
gspo_train_main() {
  local overrides=()
  while (($#)); do
    case $1 in
      --dry-run) GSPO_DRY_RUN=1 ;;
      --nodelist) GSPO_DRY_NODELIST=${2:?--nodelist needs a host list}; shift ;;
      --nodelist=*) GSPO_DRY_NODELIST=${1#*=} ;;
      *) overrides+=("$1") ;;
    esac
    shift
  done
  if ((${GSPO_DRY_RUN:-0})); then
    SLURM_JOB_ID=${SLURM_JOB_ID:-0} SLURM_JOB_NAME=${SLURM_JOB_NAME:-$GSPO_JOB_NAME}
    SLURM_SUBMIT_DIR=${SLURM_SUBMIT_DIR:-$GSPO_REPO}
  else
    [[ -z ${GSPO_DRY_NODELIST:-} ]] || gspo_fail 2 "--nodelist is for --dry-run only (a job uses its allocation)"
    gspo_require_slurm
  fi
  gspo_setup_run_dir
  gspo_install_traps
  if ! ((${GSPO_DRY_RUN:-0})); then gspo_check_preemption_config; fi
  gspo_refuse_retired_settings
  gspo_grid_overrides
  [[ $GSPO_PROFILE == gpu || $GSPO_PROFILE == cpu ]] || gspo_fail 2 "GSPO_PROFILE must be gpu or cpu, got '$GSPO_PROFILE'"
  [[ -r $GSPO_CONFIG ]] || gspo_fail 2 "config file not found: $GSPO_CONFIG"
  gspo_export_runtime_env
  if ((${GSPO_DRY_RUN:-0})); then gspo_print_dry_run_header; fi
  gspo_launch_plan "${GSPO_PROFILE_OVERRIDES[@]}" "${overrides[@]}" "${GSPO_GRID_OVERRIDES[@]}"
  gspo_check_mounts
  gspo_log "learner nodes ${GSPO_LEARNER_NODES[*]}; rollout nodes ${GSPO_ROLLOUT_NODES[*]:-none}"
  if ((${GSPO_DRY_RUN:-0})); then printf '# %s\n' "${GSPO_PLAN_NOTES[@]}"; fi
  if ((${#GSPO_HEALTH_URLS[@]})); then
    if ((${GSPO_DRY_RUN:-0})); then
      printf '# the rollout servers, one step each:\n'
      printf '#   %s\n' "${GSPO_SERVER_LINES[@]}"
    fi
    gspo_fleet_start
  fi
  if ((GSPO_PREEMPTED == 1)); then
    # The warning came while the servers started: nothing to save yet, come back later.
    gspo_stop_steps
    gspo_requeue "SIGUSR1 before the learner started"
  fi
  # torchrun dies on SIGUSR1 by default and, asked to handle SIGTERM, kills its workers 30 s
  # later: it ignores both here (the ignore is inherited; the launch plan keeps SIGTERM out of
  # its --signals-to-handle), and the trainer installs its own handler, so a forwarded USR1 and
  # a preemption's SIGTERM reach exactly the training ranks. Stopping the step (srun's TERM)
  # still kills it.
  if ((${GSPO_DRY_RUN:-0})); then printf '# the learners (torchrun numbers the ranks at rendezvous):\n'; fi
  gspo_start_step main learner "${GSPO_LEARNER_SRUN[@]}" -- \
    bash -c 'trap "" USR1 TERM; exec "$@"' gspo-learner "${GSPO_LEARNER_ARGV[@]}"
  if ((${GSPO_DRY_RUN:-0})); then
    rm -rf "$GSPO_PLAN_DIR"
    exit 0
  fi
  gspo_supervise
}

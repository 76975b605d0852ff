# shellcheck shell=bash
# Shared functions of the slurm/ job scripts: run directory and logs, srun steps (bare or in a
# pyxis container; printed instead in a dry run), health waits, step supervision, preemption and
# requeue. Where each step runs is decided in Python (gspo_megatron/launch, slurm/train_job.sh).
#
# Sourced by slurm/gspo_30b.sh, slurm/tiny_cpu.sh (with slurm/train_job.sh), slurm/convert.sh
# and slurm/export.sh; it defines functions only. Supervision rule: the job has one main step
# (the learner, or the convert / export process) and optional service steps (rollout servers).
# When the main step ends, the services are stopped and the job exits with the main step's
# code. When a service step ends first, or any step fails, every other step is stopped and the
# job exits with the failing step's code and a message naming it, so no server is left behind.
# SIGUSR1 (Slurm's `--signal=B:USR1@T` warning before the time limit) and SIGTERM while the job's
# end time still leaves room (a preemption with GraceTime: Slurm moves the end time to now +
# GraceTime) ask the learner for a checkpoint: the shell writes the time by which the learner must
# have exited (the job's end time from squeue less GSPO_REQUEUE_LEAD_S) into GSPO_DEADLINE_FILE
# and passes SIGUSR1 on. The learner finishes its step and saves, or drops a step that cannot
# finish in time and saves the last completed one (exit 124), or, with no room for a save, stops
# without one (exit 125, trainer/deadline.py); the job then requeues itself and resumes, and the
# log says which checkpoint it resumes from and how many steps it redoes. A learner still running
# GSPO_HARD_STOP_GRACE_S after its deadline is stopped and the job requeued the same way.

readonly GSPO_REQUEUE_EXIT_CODE=124
readonly GSPO_NO_CHECKPOINT_EXIT_CODE=125

gspo_log() {
  local line
  line="[$(date -u +%Y-%m-%dT%H:%M:%S) gspo job ${SLURM_JOB_ID:-none}] $*"
  printf '%s\n' "$line" >&2
  if [[ -n ${GSPO_JOB_LOG:-} ]]; then printf '%s\n' "$line" >>"$GSPO_JOB_LOG"; fi
}

# gspo_fail CODE MESSAGE [STEP_LOG]: stop every step, say why (with the end of the failing
# step's log), exit with CODE (never 0).
gspo_fail() {
  local code=$1 message=$2 log=${3:-}
  ((code != 0)) || code=1
  gspo_log "FAILED (exit code $code): $message"
  if [[ -n $log && -r $log ]]; then
    # Under torchrun the cause is in the ranks' tracebacks ("[rankN]: ..."), not in its summary.
    local pattern='^\[rank[0-9]+\]:'
    if grep -qE "$pattern" "$log"; then
      gspo_log "end of the ranks' errors in $log:"
      grep -E "$pattern" "$log" | tail -n "${GSPO_FAIL_LOG_LINES:-12}"
    else
      gspo_log "last lines of $log:"
      tail -n "${GSPO_FAIL_LOG_LINES:-20}" "$log"
    fi | sed 's/^/    | /' | tee -a "${GSPO_JOB_LOG:-/dev/null}" >&2
  fi
  gspo_stop_steps
  exit "$code"
}

gspo_require_slurm() {
  [[ -n ${SLURM_JOB_ID:-} ]] || {
    echo "error: $0 is a Slurm batch script; submit it with sbatch" >&2
    exit 2
  }
}

# Run directory: everything of the job goes under it (logs/<job id>/, checkpoints, exports).
# GSPO_RUN_DIR is kept across requeues (same job id), so a requeued job finds its checkpoints.
gspo_setup_run_dir() {
  local job_key=${SLURM_JOB_ID}
  if [[ -n ${SLURM_ARRAY_JOB_ID:-} ]]; then job_key="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"; fi
  if [[ -n ${GSPO_GRID_DIR:-} && -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
    GSPO_RUN_DIR="${GSPO_GRID_DIR}/point_${SLURM_ARRAY_TASK_ID}"
  fi
  GSPO_RUN_DIR=${GSPO_RUN_DIR:-${SLURM_SUBMIT_DIR}/runs/${SLURM_JOB_NAME}-${job_key}}
  GSPO_RESTART=${SLURM_RESTART_COUNT:-0}
  GSPO_LOG_DIR="${GSPO_RUN_DIR}/logs/${job_key}"
  if ((${GSPO_DRY_RUN:-0})); then
    # Nothing is written under the run directory; the plan goes to a scratch folder.
    # shellcheck disable=SC2034  # read by slurm/train_job.sh
    GSPO_PLAN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gspo-dry-run.XXXXXX")
    export GSPO_RUN_DIR GSPO_LOG_DIR GSPO_RESTART
    return 0
  fi
  # shellcheck disable=SC2034  # read by slurm/train_job.sh
  GSPO_PLAN_DIR=$GSPO_LOG_DIR
  mkdir -p "$GSPO_LOG_DIR" || {
    echo "error: cannot create the log directory $GSPO_LOG_DIR" >&2
    exit 1
  }
  GSPO_JOB_LOG="${GSPO_LOG_DIR}/batch.log"
  # per run of the job: a requeued run must not read the deadline of the one before
  GSPO_DEADLINE_FILE="${GSPO_LOG_DIR}/deadline.r${GSPO_RESTART}.env"
  export GSPO_RUN_DIR GSPO_LOG_DIR GSPO_RESTART GSPO_DEADLINE_FILE
  gspo_log "run dir $GSPO_RUN_DIR, nodes ${SLURM_JOB_NODELIST:-?}, restart $GSPO_RESTART"
}

# Overrides of one grid point (gspo-grid submit, gspo_megatron/grid/spec.py, writes one per line).
gspo_grid_overrides() {
  GSPO_GRID_OVERRIDES=()
  if [[ -n ${GSPO_GRID_DIR:-} && -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
    local file="${GSPO_GRID_DIR}/points/${SLURM_ARRAY_TASK_ID}.overrides"
    [[ -r $file ]] || gspo_fail 2 "grid point file $file is missing"
    mapfile -t GSPO_GRID_OVERRIDES <"$file"
    gspo_log "grid point ${SLURM_ARRAY_TASK_ID}: ${GSPO_GRID_OVERRIDES[*]}"
  fi
}

# Address other nodes reach NODE at: its Slurm NodeAddr (the host name on most clusters).
gspo_node_addr() {
  local addr
  addr=$(scontrol show node -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
  printf '%s\n' "${addr:-$1}"
}

# srun options that put a step into the pyxis container when GSPO_CONTAINER_IMAGE is set. Mounts:
# GSPO_MOUNTS (the launch plan's, derived from the config) when set, else the repository, the
# run directory and GSPO_EXTRA_MOUNT_PATHS (a stage's own inputs and outputs), plus the
# GSPO_CONTAINER_MOUNTS entries.
gspo_container_args() {
  GSPO_CONTAINER_ARGS=()
  [[ -n ${GSPO_CONTAINER_IMAGE:-} ]] || return 0
  local mounts=${GSPO_MOUNTS:-} path
  if [[ -z $mounts ]]; then
    mounts="${GSPO_REPO}:${GSPO_REPO},${GSPO_RUN_DIR}:${GSPO_RUN_DIR}"
    for path in "${GSPO_EXTRA_MOUNT_PATHS[@]}"; do mounts+=",${path}:${path}"; done
    if [[ -n ${GSPO_CONTAINER_MOUNTS:-} ]]; then mounts+=",${GSPO_CONTAINER_MOUNTS}"; fi
  fi
  # Named: each node unpacks the image once per job and later steps reuse it.
  GSPO_CONTAINER_ARGS=("--container-image=${GSPO_CONTAINER_IMAGE}" "--container-name=gspo"
    "--container-workdir=${GSPO_REPO}" "--container-mounts=${mounts}")
}

GSPO_EXTRA_MOUNT_PATHS=()
GSPO_STEP_PIDS=()
GSPO_STEP_NAMES=()
GSPO_MAIN_PID=""
GSPO_PREEMPTED=0
GSPO_REQUEUED=0
GSPO_USR1_SENT_AT=0
GSPO_EXIT_BY=""

# gspo_start_step main|service NAME SRUN_OPTIONS... -- COMMAND...: one srun step in the
# background, its output in $GSPO_LOG_DIR/NAME.r<restart>.log. A dry run prints the srun line.
gspo_start_step() {
  local role=$1 name=$2 opts=()
  shift 2
  while (($#)) && [[ $1 != -- ]]; do
    opts+=("$1")
    shift
  done
  shift
  gspo_container_args
  local cmd=(srun --overlap --kill-on-bad-exit=1 --job-name="$name"
    --output="${GSPO_LOG_DIR}/${name}.r${GSPO_RESTART}.log" "${GSPO_CONTAINER_ARGS[@]}" "${opts[@]}" "$@")
  if ((${GSPO_DRY_RUN:-0})); then
    gspo_print_command "${cmd[@]}"
    return 0
  fi
  "${cmd[@]}" &
  GSPO_STEP_PIDS+=("$!")
  GSPO_STEP_NAMES+=("$name")
  if [[ $role == main ]]; then GSPO_MAIN_PID=$!; fi
  gspo_log "started $role step '$name' (srun pid $!): $*"
}

# One command line on stdout, each argument quoted only when the shell needs it (a dry run).
gspo_print_command() {
  local arg words=()
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then words+=("$arg"); else words+=("${arg@Q}"); fi
  done
  printf '%s\n' "${words[*]}"
}

gspo_any_step_alive() {
  local pid
  for pid in "${GSPO_STEP_PIDS[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then return 0; fi
  done
  return 1
}

# Stop every running step: TERM through srun (it forwards to the tasks), KILL after the grace.
gspo_stop_steps() {
  local pid deadline
  if declare -F gspo_fleet_stop_probe >/dev/null; then gspo_fleet_stop_probe; fi
  for pid in "${GSPO_STEP_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  deadline=$((SECONDS + ${GSPO_KILL_GRACE_S:-30}))
  while gspo_any_step_alive && ((SECONDS < deadline)); do sleep 0.5; done
  for pid in "${GSPO_STEP_PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  for pid in "${GSPO_STEP_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  GSPO_STEP_PIDS=()
}

# The job's end time in unix seconds (the time limit's, or now + GraceTime once preempted), or
# nothing when Slurm cannot say (no time limit, squeue unreachable).
gspo_job_end_epoch() {
  local job=${SLURM_JOB_ID:-} out
  [[ -n $job ]] || return 0
  out=$(SLURM_TIME_FORMAT=%s timeout 10 squeue -h -j "$job" -o %e 2>/dev/null | head -n 1) || true
  if [[ $out =~ ^[0-9]+$ ]]; then printf '%s\n' "$out"; fi
}

# Write GSPO_DEADLINE_FILE: the time by which the learner must have exited, GSPO_REQUEUE_LEAD_S
# (60) before the job's end, so that the servers can be stopped and the job requeued.
gspo_write_deadline() {
  local end now
  end=$(gspo_job_end_epoch)
  now=$(date +%s)
  if [[ -z $end ]]; then
    GSPO_EXIT_BY=""
    gspo_log "the job's end time is unknown (squeue -o %e): the learner finishes its step and saves"
    return 0
  fi
  GSPO_EXIT_BY=$((end - ${GSPO_REQUEUE_LEAD_S:-60}))
  printf 'exit_by=%s\njob_end=%s\n' "$GSPO_EXIT_BY" "$end" >"${GSPO_DEADLINE_FILE}.tmp" &&
    mv -f "${GSPO_DEADLINE_FILE}.tmp" "$GSPO_DEADLINE_FILE"
  gspo_log "the job ends in $((end - now)) s; the learner must have exited in $((GSPO_EXIT_BY - now)) s ($GSPO_DEADLINE_FILE)"
}

# Slurm's preemption sends SIGTERM to the job's steps, not to this shell, and to the rollout
# servers too; with PreemptParameters=send_user_signal it sends the job's own warning (B:USR1)
# here instead, with the end moved to now + GraceTime, which the deadline rule plans with. Say so
# when the cluster preempts without it (docs/cluster.md).
gspo_check_preemption_config() {
  local config
  config=$(timeout 10 scontrol show config 2>/dev/null) || return 0
  grep -Eq '^PreemptType += preempt/(qos|partition_prio)' <<<"$config" || return 0
  grep -Eq '^PreemptMode += OFF' <<<"$config" && return 0
  grep -Eq '^PreemptParameters += .*send_user_signal' <<<"$config" && return 0
  gspo_log "warning: this cluster preempts jobs without PreemptParameters=send_user_signal: a preemption's SIGTERM reaches the learner without a deadline and stops the rollout servers, so the step in progress may be lost (docs/cluster.md, 'Time limits, preemption and requeue')"
}

# Slurm's warning before the time limit (or a preemption notice): ask the learner to checkpoint.
gspo_on_usr1() {
  GSPO_PREEMPTED=1
  gspo_log "SIGUSR1 received (time limit or preemption ahead): asking the learner to checkpoint"
  gspo_write_deadline
  gspo_forward_usr1
}

# srun passes USR1 on to every task of the learner step. A rank that has not installed its
# handler yet ignores it (inherited from the torchrun wrapper), so the supervisor repeats it.
gspo_forward_usr1() {
  GSPO_USR1_SENT_AT=$SECONDS
  if [[ -n $GSPO_MAIN_PID ]]; then kill -USR1 "$GSPO_MAIN_PID" 2>/dev/null || true; fi
}

gspo_on_term() {
  local end
  if ((GSPO_REQUEUED == 1)); then
    gspo_log "this run of the job ends; it is requeued"
    exit 0
  fi
  end=$(gspo_job_end_epoch)
  if [[ -n $GSPO_MAIN_PID && -n $end ]] && ((end - $(date +%s) > ${GSPO_REQUEUE_LEAD_S:-60})); then
    # A preemption with GraceTime: the end is still ahead, so this is a warning like USR1.
    GSPO_PREEMPTED=1
    gspo_log "SIGTERM received with $((end - $(date +%s))) s to the job's end (preemption with GraceTime): asking the learner to checkpoint"
    gspo_write_deadline
    gspo_forward_usr1
    return 0
  fi
  gspo_log "SIGTERM received (job cancelled or out of time): stopping every step"
  GSPO_KILL_GRACE_S=${GSPO_KILL_GRACE_S:-10}
  gspo_stop_steps
  exit 143
}

gspo_install_traps() {
  trap gspo_on_usr1 USR1
  trap gspo_on_term TERM
}

# What the learner recorded in GSPO_RUN_DIR/progress.env: its newest trained step and the newest
# checkpoint (trainer/preemption.py writes it); "; <sentence>", or nothing without the file.
gspo_progress_note() {
  local file="${GSPO_RUN_DIR}/progress.env" trained ckpt
  [[ -r $file ]] || return 0
  trained=$(sed -n 's/^trained_step=//p' "$file")
  ckpt=$(sed -n 's/^checkpoint_step=//p' "$file")
  [[ $trained =~ ^[0-9]+$ ]] || return 0
  if [[ $ckpt =~ ^[0-9]+$ ]]; then
    printf '; the resumed run starts from the checkpoint of step %s and redoes %s step(s)' \
      "$ckpt" "$((trained - ckpt))"
  else
    printf '; no checkpoint of this run yet: the resumed run redoes its %s step(s)' "$trained"
  fi
}

# Requeue this job; Slurm restarts it (SLURM_RESTART_COUNT + 1) and the trainer resumes.
gspo_requeue() {
  local reason=${1:-learner checkpointed} max=${GSPO_MAX_REQUEUES:-20} job=$SLURM_JOB_ID
  if [[ -n ${SLURM_ARRAY_JOB_ID:-} ]]; then job="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"; fi
  ((GSPO_RESTART < max)) || gspo_fail "$GSPO_REQUEUE_EXIT_CODE" \
    "$reason, but the job was already requeued $GSPO_RESTART times (GSPO_MAX_REQUEUES=$max)"
  gspo_log "$reason; requeueing job $job (restart $((GSPO_RESTART + 1)))"
  GSPO_REQUEUED=1
  scontrol requeue "$job" || gspo_fail "$GSPO_REQUEUE_EXIT_CODE" \
    "$reason, but 'scontrol requeue $job' failed; resubmit the job to resume"
  # Slurm now ends this run of the job; wait for it rather than racing it with an exit code.
  sleep 60
  exit 0
}

# Did the learner exit with WANTED (124: to be requeued; 125: requeue without a checkpoint)?
# torchrun turns a worker's exit code into 1, but writes the worker's own code into the step log
# ("exitcode : 124").
gspo_learner_exited_with() {
  local wanted=$1 code=$2 log=$3
  ((code == wanted)) && return 0
  ((code != 0)) && [[ -r $log ]] && grep -Eq "exitcode *: *${wanted}\b" "$log"
}

gspo_learner_checkpointed() {
  gspo_learner_exited_with "$GSPO_REQUEUE_EXIT_CODE" "$@"
}

gspo_learner_stopped_for_requeue() {
  gspo_learner_checkpointed "$@" || gspo_learner_exited_with "$GSPO_NO_CHECKPOINT_EXIT_CODE" "$@"
}

# The main step ended with CODE: decide between success, requeue and failure.
gspo_main_step_done() {
  local name=$1 code=$2 log="${GSPO_LOG_DIR}/${1}.r${GSPO_RESTART}.log"
  if ((code == 0)); then
    gspo_log "main step '$name' finished"
    gspo_stop_steps
    gspo_log "job done"
    exit 0
  fi
  if gspo_learner_checkpointed "$code" "$log"; then
    GSPO_KILL_GRACE_S=${GSPO_KILL_GRACE_S:-10}
    gspo_stop_steps
    gspo_requeue "learner checkpointed$(gspo_progress_note)"
  fi
  if gspo_learner_exited_with "$GSPO_NO_CHECKPOINT_EXIT_CODE" "$code" "$log"; then
    GSPO_KILL_GRACE_S=${GSPO_KILL_GRACE_S:-10}
    gspo_stop_steps
    gspo_requeue "learner stopped WITHOUT a checkpoint: no room for a save before the job's deadline$(gspo_progress_note)"
  fi
  if ((GSPO_PREEMPTED == 1)); then
    gspo_fail "$code" "main step '$name' exited with code $code after SIGUSR1 without \
checkpointing (exit $GSPO_REQUEUE_EXIT_CODE); not requeued; log: $log" "$log"
  fi
  gspo_fail "$code" "main step '$name' exited with code $code; log: $log" "$log"
}

# The first helper step (not the main one) that has ended: "INDEX CODE" in GSPO_ENDED_HELPER.
gspo_reap_ended_helper() {
  local i pid code
  GSPO_ENDED_HELPER=""
  for i in "${!GSPO_STEP_PIDS[@]}"; do
    pid=${GSPO_STEP_PIDS[$i]}
    [[ $pid != "$GSPO_MAIN_PID" ]] || continue
    kill -0 "$pid" 2>/dev/null && continue
    code=0
    wait "$pid" || code=$?
    GSPO_ENDED_HELPER="$i $code"
    return 0
  done
  return 1
}

# Poll the steps until the job is decided; wakes within a second for signals and exits.
# A rollout server's step that ends while the main step runs goes to slurm/fleet.sh (restart,
# or the end of the job once its restart budget is spent); any other helper step ending then
# fails the job. A server that crashes may make the learner fail within seconds, and srun may
# report the learner's exit before the server's: when the main step fails (not for a requeue),
# a helper step that ends within GSPO_HELPER_EXIT_WAIT_S (5) seconds, or had ended already, is
# named as the cause (which step the poll visits first must not decide the message), unless no
# server was up at all: then the job is requeued (slurm/fleet.sh, gspo_fleet_all_down).
gspo_supervise() {
  local i code log main_name main_code helper deadline
  while true; do
    main_code=""
    for i in "${!GSPO_STEP_PIDS[@]}"; do
      [[ ${GSPO_STEP_PIDS[$i]} == "$GSPO_MAIN_PID" ]] || continue
      kill -0 "$GSPO_MAIN_PID" 2>/dev/null && break
      main_name=${GSPO_STEP_NAMES[$i]} main_code=0
      wait "$GSPO_MAIN_PID" || main_code=$?
    done
    gspo_reap_ended_helper || true
    helper=$GSPO_ENDED_HELPER
    if [[ -n $main_code ]] && { ((main_code == 0)) || gspo_learner_stopped_for_requeue "$main_code" \
      "${GSPO_LOG_DIR}/${main_name}.r${GSPO_RESTART}.log"; }; then
      gspo_main_step_done "$main_name" "$main_code"
    fi
    if [[ -z $main_code && -n $helper ]] && declare -F gspo_fleet_on_exit >/dev/null; then
      read -r i code <<<"$helper"
      if gspo_fleet_on_exit "${GSPO_STEP_PIDS[$i]}" "$code"; then helper=""; fi
    fi
    if [[ -n $main_code && -z $helper ]] && ((${#GSPO_STEP_PIDS[@]} > 1)); then
      deadline=$((SECONDS + ${GSPO_HELPER_EXIT_WAIT_S:-5}))
      while ((SECONDS < deadline)) && ! gspo_reap_ended_helper; do sleep 0.5; done
      helper=$GSPO_ENDED_HELPER
    fi
    if [[ -n $main_code ]] && declare -F gspo_fleet_all_down >/dev/null; then
      if [[ -n $helper ]]; then
        read -r i code <<<"$helper"
        gspo_fleet_note_exit "${GSPO_STEP_PIDS[$i]}" "$code" || true
      fi
      if gspo_fleet_all_down; then
        GSPO_KILL_GRACE_S=${GSPO_KILL_GRACE_S:-10}
        gspo_stop_steps
        gspo_requeue "main step '$main_name' exited with code $main_code while $GSPO_FLEET_ALL_DOWN_NOTE; \
the job resumes from its last checkpoint$(gspo_progress_note)"
      fi
    fi
    if [[ -n $helper ]]; then
      read -r i code <<<"$helper"
      log="${GSPO_LOG_DIR}/${GSPO_STEP_NAMES[$i]}.r${GSPO_RESTART}.log"
      gspo_fail "$code" "step '${GSPO_STEP_NAMES[$i]}' exited with code $code while the main step was running; log: $log" "$log"
    fi
    [[ -z $main_code ]] || gspo_main_step_done "$main_name" "$main_code"
    if declare -F gspo_fleet_tick >/dev/null; then gspo_fleet_tick; fi
    if ((GSPO_PREEMPTED == 1)) && [[ -n $GSPO_EXIT_BY ]] &&
      (($(date +%s) >= GSPO_EXIT_BY + ${GSPO_HARD_STOP_GRACE_S:-15})); then
      gspo_log "the learner is still running $(($(date +%s) - GSPO_EXIT_BY)) s past its deadline: stopping it"
      GSPO_KILL_GRACE_S=${GSPO_KILL_GRACE_S:-10}
      gspo_stop_steps
      gspo_requeue "learner stopped WITHOUT a checkpoint at the job's deadline$(gspo_progress_note)"
    fi
    if ((GSPO_PREEMPTED == 1 && SECONDS - GSPO_USR1_SENT_AT >= ${GSPO_USR1_REPEAT_S:-60})); then
      # for ranks that had not installed their handler yet; a rank that has it carries on (and
      # reads the deadline again: an operator may have moved the job's end)
      gspo_log "learner still running after SIGUSR1; sending it again"
      gspo_write_deadline
      gspo_forward_usr1
    fi
    sleep 1 &
    wait $! || true
  done
}

# gspo_wait_healthy TIMEOUT_S URL...: every URL answers 200, or the job fails (also fails early
# when a step dies while we wait).
gspo_wait_healthy() {
  local timeout=$1 pending deadline i code log
  shift
  if ((${GSPO_DRY_RUN:-0})); then
    printf '# then wait up to %ss for: %s\n' "$timeout" "$*"
    return 0
  fi
  pending=("$@")
  deadline=$((SECONDS + timeout))
  while ((${#pending[@]})); do
    for i in "${!pending[@]}"; do
      if curl -sf --max-time 5 -o /dev/null "${pending[$i]}"; then
        gspo_log "healthy: ${pending[$i]}"
        unset 'pending[i]'
      fi
    done
    ((${#pending[@]})) || break
    for i in "${!GSPO_STEP_PIDS[@]}"; do
      kill -0 "${GSPO_STEP_PIDS[$i]}" 2>/dev/null && continue
      code=0
      wait "${GSPO_STEP_PIDS[$i]}" || code=$?
      log="${GSPO_LOG_DIR}/${GSPO_STEP_NAMES[$i]}.r${GSPO_RESTART}.log"
      gspo_fail "$code" "step '${GSPO_STEP_NAMES[$i]}' exited (code $code) before the servers were healthy; log: $log" "$log"
    done
    ((SECONDS < deadline)) || gspo_fail 1 "servers not healthy after ${timeout}s: ${pending[*]}"
    sleep 2 &
    wait $! || true
  done
}

# Defaults shared by every profile; the job scripts set theirs before calling in.
gspo_export_runtime_env() {
  GSPO_PROFILE=${GSPO_PROFILE:-gpu}
  export PYTHONUNBUFFERED=1
  if [[ $GSPO_PROFILE == cpu ]]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    export CUDA_VISIBLE_DEVICES=""
    return
  fi
  # Values already in the environment win, so a cluster's own NCCL settings pass through.
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
  export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
  export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-7}
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  if [[ -n ${NCCL_IB_HCA:-} ]]; then export NCCL_IB_HCA; fi
  if [[ -n ${NCCL_SOCKET_IFNAME:-} ]]; then
    export NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}
  fi
}

# CPUs for each of N tasks on a node: the node's share of the job split evenly (steps must say
# so explicitly; srun does not reliably inherit sbatch's --cpus-per-task).
gspo_cpus_per_task() {
  local cpus=$((${SLURM_CPUS_ON_NODE:-1} / $1))
  echo $((cpus > 0 ? cpus : 1))
}

# Entry point of slurm/convert.sh and slurm/export.sh (after gspo_setup_run_dir): one process
# on one node, supervised.
gspo_single_step_main() {
  local name=$1
  shift
  gspo_install_traps
  gspo_export_runtime_env
  gspo_start_step main "$name" --nodes=1 --ntasks=1 --cpus-per-task="$(gspo_cpus_per_task 1)" -- "$@"
  gspo_supervise
}

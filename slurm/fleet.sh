# shellcheck shell=bash
# The rollout fleet of a training job: one Slurm step per server, and what the job does when a
# server dies or hangs while the learner runs. Sourced by slurm/train_job.sh after slurm/lib.sh;
# defines functions only. docs/cluster.md, "When a rollout server dies", says it for users.
#
# Each server runs in its own step (`srun --nodes=1 --ntasks=1 --nodelist=<its node>`), so one
# server's exit ends no other. The supervisor (gspo_supervise in slurm/lib.sh) hands every
# server step that ends to gspo_fleet_on_exit and calls gspo_fleet_tick once a poll, which:
#   - probes every server's /health_generate in the background (GSPO_FLEET_PROBE_S, 5 s). SGLang
#     answers it only when its scheduler produced output within 20 s (srt/entrypoints/
#     http_server.py, health_generate), so a stuck scheduler fails it where a live front end
#     would still accept connections. A server that had been healthy and has not answered 200
#     for GSPO_SERVER_HANG_TIMEOUT_S (rollout.sglang.hang_timeout_s) is hung: its step is killed
#     (scancel --signal=KILL on the step) and it goes down like a dead one. While the learner
#     holds the fleet paused (a weight sync, released memory: SGLang's health request then
#     waits in its queue), it keeps GSPO_FLEET_PAUSE_FILE; the hang clock does not run then.
#   - restarts a server that went down (its exit code, a hang, or a restart that did not get
#     healthy within GSPO_HEALTH_TIMEOUT_S) in a new step on the same node, with the same port
#     and keys, GSPO_SERVER_RESTART_DELAY_S (2 s) later; its log goes on in the same file. The
#     learner keeps training on the others; the restarted server serves the initial weights, so
#     the learner's pool admits it only at its next weight sync, which sends it the current
#     weights and probes it (rollout/sglang/control.py, server_pool.py).
#   - at most GSPO_SERVER_RESTARTS_PER_HOUR (rollout.sglang.restarts_per_hour) restarts of one
#     server within any hour: one more death ends the job, naming the server and quoting its
#     log. 0: the first death ends the job, as before restarts existed.
# Every death, restart and recovery is a line of GSPO_FLEET_EVENTS (<run dir>/fleet_events.jsonl),
# which the learner reads for its rollout/server_* metrics, and of the job log.
# When the learner fails while no server is up (every server dead at once: a rollout node lost),
# the job is requeued and resumes from its last checkpoint (gspo_fleet_all_down).

GSPO_FLEET_PID=()       # srun pid of the server's current step ("" while it is down)
GSPO_FLEET_STATE=()     # starting | up | down
GSPO_FLEET_SINCE=()     # SECONDS when it entered that state
GSPO_FLEET_LAST_OK=()   # SECONDS of its last 200 on the probe (hang clock; moved on while paused)
GSPO_FLEET_DOWN_AT=()   # epoch seconds when it went down last
GSPO_FLEET_RESTARTS=()  # epoch seconds of its restarts, space-separated
GSPO_FLEET_REASON=()    # why it went down last
GSPO_FLEET_PROBE_PID=""
GSPO_FLEET_PROBE_AT=0

# A JSON string of ARG (quotes, backslashes and control characters escaped).
gspo_json_string() {
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  s=${s//$'\t'/\\t}
  s=${s//[$'\001'-$'\037']/?}
  printf '"%s"' "$s"
}

# gspo_fleet_event J EVENT [CODE] [REASON] [DOWN_S]: one line of the events file.
gspo_fleet_event() {
  local j=$1 event=$2 code=${3:-} reason=${4:-} down_s=${5:-} line
  [[ -n ${GSPO_FLEET_EVENTS:-} ]] || return 0
  line=$(printf '{"time": %s, "job": %s, "job_restart": %s, "server": %s, "address": %s, "node": %s, "event": %s, "code": %s, "reason": %s, "down_s": %s, "restarts_last_hour": %s}' \
    "$(date +%s.%N)" "$(gspo_json_string "${SLURM_JOB_ID:-}")" "${GSPO_RESTART:-0}" \
    "$(gspo_json_string "${GSPO_SERVER_NAMES[$j]}")" "$(gspo_json_string "${GSPO_SERVER_ADDRESSES[$j]}")" \
    "$(gspo_json_string "${GSPO_SERVER_NODES[$j]}")" "$(gspo_json_string "$event")" "${code:-null}" \
    "$(gspo_json_string "$reason")" "${down_s:-null}" "$(gspo_fleet_restarts_last_hour "$j")")
  printf '%s\n' "$line" >>"$GSPO_FLEET_EVENTS"
}

gspo_fleet_log_file() {
  printf '%s\n' "${GSPO_LOG_DIR}/${GSPO_SERVER_NAMES[$1]}.r${GSPO_RESTART}.log"
}

gspo_fleet_describe() {
  printf '%s\n' "rollout server ${GSPO_SERVER_NAMES[$1]} (${GSPO_SERVER_ADDRESSES[$1]} on ${GSPO_SERVER_NODES[$1]})"
}

# Start server J's step (first start or restart); its log is appended to.
gspo_fleet_start_server() {
  local j=$1 name=${GSPO_SERVER_NAMES[$1]}
  gspo_start_step service "$name" "${GSPO_SERVER_SRUN[@]}" "--nodelist=${GSPO_SERVER_NODES[$j]}" \
    --open-mode=append -- bash "$GSPO_REPO/slurm/rollout_server.sh" "$name"
  ((${GSPO_DRY_RUN:-0})) && return 0
  GSPO_FLEET_PID[j]=${GSPO_STEP_PIDS[-1]}
  GSPO_FLEET_STATE[j]=starting
  GSPO_FLEET_SINCE[j]=$SECONDS
  GSPO_FLEET_LAST_OK[j]=$SECONDS
}

# Start every server, then wait until each answers /health (the job fails if one dies first).
gspo_fleet_start() {
  local j
  GSPO_FLEET_EVENTS="${GSPO_RUN_DIR}/fleet_events.jsonl"
  GSPO_FLEET_PAUSE_FILE="${GSPO_LOG_DIR}/fleet_paused.r${GSPO_RESTART}"
  export GSPO_FLEET_PAUSE_FILE
  for j in "${!GSPO_SERVER_NAMES[@]}"; do
    GSPO_FLEET_RESTARTS[j]=""
    gspo_fleet_start_server "$j"
  done
  gspo_wait_healthy "$GSPO_HEALTH_TIMEOUT_S" "${GSPO_HEALTH_URLS[@]}"
  ((${GSPO_DRY_RUN:-0})) && return 0
  : >>"$GSPO_FLEET_EVENTS" # the learner's rollout/server_* metrics read it: 0 restarts so far
  for j in "${!GSPO_SERVER_NAMES[@]}"; do
    GSPO_FLEET_STATE[j]=up
    GSPO_FLEET_LAST_OK[j]=$SECONDS
  done
}

# The fleet index of the server whose current step is srun PID (nothing if none).
gspo_fleet_index_of_pid() {
  local j
  for j in "${!GSPO_SERVER_NAMES[@]}"; do
    if [[ ${GSPO_FLEET_PID[$j]:-} == "$1" ]]; then
      printf '%s\n' "$j"
      return 0
    fi
  done
  return 1
}

# Forget step PID (ended and reaped) in the supervisor's lists.
gspo_forget_step() {
  local i pids=() names=()
  for i in "${!GSPO_STEP_PIDS[@]}"; do
    [[ ${GSPO_STEP_PIDS[$i]} == "$1" ]] && continue
    pids+=("${GSPO_STEP_PIDS[$i]}")
    names+=("${GSPO_STEP_NAMES[$i]}")
  done
  GSPO_STEP_PIDS=("${pids[@]}")
  GSPO_STEP_NAMES=("${names[@]}")
}

gspo_fleet_restarts_last_hour() {
  local t count=0 now
  now=$(date +%s)
  for t in ${GSPO_FLEET_RESTARTS[$1]:-}; do ((now - t < 3600)) && count=$((count + 1)); done
  printf '%s\n' "$count"
}

# Kill server J's step at once (a hung server ignores TERM: SIGSTOP, or a kernel that never
# returns), on its node through Slurm, then the local srun; reap it.
gspo_fleet_kill() {
  local j=$1 pid=${GSPO_FLEET_PID[$1]} name=${GSPO_SERVER_NAMES[$1]} step steps=() deadline
  if [[ -n ${SLURM_JOB_ID:-} ]] && command -v squeue >/dev/null; then
    mapfile -t steps < <(timeout 10 squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null |
      awk -v n="$name" '$2 == n {print $1}')
  fi
  for step in "${steps[@]}"; do timeout 10 scancel --signal=KILL "$step" 2>/dev/null || true; done
  if ((${#steps[@]})); then # srun ends once Slurm reports the step's task killed
    deadline=$((SECONDS + 10))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
  fi
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  gspo_forget_step "$pid"
}

# Server J went down (its step ended with CODE, already reaped and forgotten, or it was killed):
# record it, then restart it later or end the job when its budget is spent.
gspo_fleet_down() {
  local j=$1 code=$2 reason=$3 log budget=${GSPO_SERVER_RESTARTS_PER_HOUR:-0} used
  log=$(gspo_fleet_log_file "$j")
  used=$(gspo_fleet_restarts_last_hour "$j")
  GSPO_FLEET_PID[j]=""
  GSPO_FLEET_STATE[j]=down
  GSPO_FLEET_SINCE[j]=$SECONDS
  GSPO_FLEET_DOWN_AT[j]=$(date +%s)
  GSPO_FLEET_REASON[j]=$reason
  gspo_fleet_event "$j" down "$code" "$reason"
  gspo_log "$(gspo_fleet_describe "$j") is down: $reason"
  if ((budget == 0)); then
    gspo_fail "$code" "$(gspo_fleet_describe "$j"): $reason while the main step was running \
(rollout.sglang.restarts_per_hour=0: a server is not restarted); log: $log" "$log"
  fi
  if ((used >= budget)); then
    gspo_fleet_event "$j" gave_up "$code" "restart budget spent: $used restart(s) within the last hour"
    gspo_fail "$code" "$(gspo_fleet_describe "$j"): $reason, after $used restart(s) within the \
last hour (rollout.sglang.restarts_per_hour=$budget): not restarted again; log: $log" "$log"
  fi
  if ! gspo_fleet_any_up; then
    gspo_log "no rollout server is up: the learner waits for the restarts, or fails and the job is requeued"
  fi
}

gspo_fleet_any_up() {
  local j
  for j in "${!GSPO_SERVER_NAMES[@]}"; do
    [[ ${GSPO_FLEET_STATE[$j]:-} == up ]] && return 0
  done
  return 1
}

# gspo_fleet_on_exit PID CODE: a step ended (reaped) while the main step runs. Returns 1 when
# PID is not a server's (the caller's rule then applies).
gspo_fleet_on_exit() {
  local pid=$1 code=$2 j what
  j=$(gspo_fleet_index_of_pid "$pid") || return 1
  gspo_forget_step "$pid"
  if [[ ${GSPO_FLEET_STATE[$j]} == starting && ${#GSPO_FLEET_RESTARTS[$j]} -gt 0 ]]; then
    what="exited with code $code during its start-up after a restart"
  else
    what="exited with code $code"
  fi
  gspo_fleet_down "$j" "$code" "$what"
}

# gspo_fleet_note_exit PID CODE: the main step failed and server step PID ended too: record it
# down (no restart: the job is being decided). Returns 1 when PID is not a server's.
gspo_fleet_note_exit() {
  local j
  j=$(gspo_fleet_index_of_pid "$1") || return 1
  GSPO_FLEET_PID[j]=""
  GSPO_FLEET_STATE[j]=down
  GSPO_FLEET_REASON[j]="exited with code $2"
  gspo_fleet_event "$j" down "$2" "exited with code $2 (the learner failed too)"
}

# Restart the servers whose delay has passed.
gspo_fleet_restart_due() {
  local j delay=${GSPO_SERVER_RESTART_DELAY_S:-2}
  for j in "${!GSPO_SERVER_NAMES[@]}"; do
    [[ ${GSPO_FLEET_STATE[$j]} == down ]] || continue
    ((SECONDS - GSPO_FLEET_SINCE[j] >= delay)) || continue
    GSPO_FLEET_RESTARTS[j]="${GSPO_FLEET_RESTARTS[$j]} $(date +%s)"
    gspo_log "restarting $(gspo_fleet_describe "$j") ($(gspo_fleet_restarts_last_hour "$j") of \
${GSPO_SERVER_RESTARTS_PER_HOUR} restart(s) within the hour used); log: $(gspo_fleet_log_file "$j")"
    printf '\n==== [%s gspo job] restarting %s after: %s ====\n' "$(date -u +%Y-%m-%dT%H:%M:%S)" \
      "${GSPO_SERVER_NAMES[$j]}" "${GSPO_FLEET_REASON[$j]}" >>"$(gspo_fleet_log_file "$j")"
    gspo_fleet_event "$j" restarted "" "${GSPO_FLEET_REASON[$j]}"
    gspo_fleet_start_server "$j"
  done
}

# Probe every server's /health_generate in one background job: "J HTTP_CODE" lines into
# $GSPO_LOG_DIR/fleet_probe (000: no answer within the curl's deadline).
gspo_fleet_probe_start() {
  local out="${GSPO_LOG_DIR}/fleet_probe" max=${GSPO_FLEET_PROBE_MAX_S:-25}
  rm -f "$out" "$out.tmp"
  (
    for j in "${!GSPO_SERVER_NAMES[@]}"; do
      [[ ${GSPO_FLEET_STATE[$j]} == down ]] && continue
      (printf '%s %s\n' "$j" "$(curl -s -o /dev/null -w '%{http_code}' --max-time "$max" \
        "${GSPO_PROBE_URLS[$j]}" 2>/dev/null || true)") >>"$out.tmp" &
    done
    wait
    mv -f "$out.tmp" "$out" 2>/dev/null || : >"$out"
  ) &
  GSPO_FLEET_PROBE_PID=$!
  GSPO_FLEET_PROBE_AT=$SECONDS
}

# The results of a finished probe, against each server's clocks.
gspo_fleet_probe_read() {
  local out="${GSPO_LOG_DIR}/fleet_probe" j http paused=0 hang=${GSPO_SERVER_HANG_TIMEOUT_S:-300}
  [[ -n $GSPO_FLEET_PROBE_PID ]] && ! kill -0 "$GSPO_FLEET_PROBE_PID" 2>/dev/null || return 0
  wait "$GSPO_FLEET_PROBE_PID" 2>/dev/null || true
  GSPO_FLEET_PROBE_PID=""
  [[ -r $out ]] || return 0
  [[ -n ${GSPO_FLEET_PAUSE_FILE:-} && -e $GSPO_FLEET_PAUSE_FILE ]] && paused=1
  while read -r j http; do
    [[ $j =~ ^[0-9]+$ && -n ${GSPO_FLEET_PID[$j]:-} ]] || continue
    # an answer from before the server's last change (a death, a restart) says nothing of it now
    ((GSPO_FLEET_SINCE[j] < GSPO_FLEET_PROBE_AT)) || continue
    if [[ $http == 200 ]]; then
      GSPO_FLEET_LAST_OK[j]=$SECONDS
      if [[ ${GSPO_FLEET_STATE[$j]} == starting ]]; then
        GSPO_FLEET_STATE[j]=up
        gspo_log "$(gspo_fleet_describe "$j") is healthy again, $(($(date +%s) - GSPO_FLEET_DOWN_AT[j])) s after it went down; it rejoins at the learner's next weight sync"
        gspo_fleet_event "$j" healthy "" "" "$(($(date +%s) - GSPO_FLEET_DOWN_AT[j]))"
      fi
      continue
    fi
    if [[ ${GSPO_FLEET_STATE[$j]} == starting ]]; then
      if ((SECONDS - GSPO_FLEET_SINCE[j] >= GSPO_HEALTH_TIMEOUT_S)); then
        gspo_fleet_kill "$j"
        gspo_fleet_down "$j" 1 "not healthy within ${GSPO_HEALTH_TIMEOUT_S} s of its restart (rollout.sglang.health_timeout_s)"
      fi
    elif ((paused)); then
      GSPO_FLEET_LAST_OK[j]=$SECONDS # the learner holds generation paused: no output is due
    elif ((SECONDS - GSPO_FLEET_LAST_OK[j] >= hang)); then
      gspo_fleet_kill "$j"
      gspo_fleet_down "$j" 0 "hung: /health_generate not answered 200 for $((SECONDS - GSPO_FLEET_LAST_OK[j])) s (rollout.sglang.hang_timeout_s=$hang; last answer: HTTP $http)"
    fi
  done <"$out"
}

# Once per supervisor poll, while the main step runs.
gspo_fleet_tick() {
  ((${#GSPO_SERVER_NAMES[@]})) || return 0
  gspo_fleet_probe_read
  gspo_fleet_restart_due
  if [[ -z $GSPO_FLEET_PROBE_PID ]] && ((SECONDS - GSPO_FLEET_PROBE_AT >= ${GSPO_FLEET_PROBE_S:-5})); then
    gspo_fleet_probe_start
  fi
}

# The main step failed: was every server down (a node lost, the whole fleet dead at once)? Then
# the cause is the fleet, and the job is requeued to resume from its last checkpoint.
gspo_fleet_all_down() {
  local j names=()
  ((${#GSPO_SERVER_NAMES[@]})) || return 1
  for j in "${!GSPO_SERVER_NAMES[@]}"; do
    [[ ${GSPO_FLEET_STATE[$j]} == up ]] && return 1
    names+=("${GSPO_SERVER_NAMES[$j]}: ${GSPO_FLEET_REASON[$j]:-starting}")
  done
  # shellcheck disable=SC2034  # read by gspo_supervise (slurm/lib.sh)
  GSPO_FLEET_ALL_DOWN_NOTE="every rollout server was down (${names[*]})"
  return 0
}

gspo_fleet_stop_probe() {
  if [[ -n $GSPO_FLEET_PROBE_PID ]]; then
    kill "$GSPO_FLEET_PROBE_PID" 2>/dev/null || true
    wait "$GSPO_FLEET_PROBE_PID" 2>/dev/null || true
    GSPO_FLEET_PROBE_PID=""
  fi
}

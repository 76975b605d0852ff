#!/usr/bin/env bash
# Run a real, private Slurm cluster on this machine, for CI and for trying the slurm/ scripts.
#
# It is the Debian slurm-wlm controller and node daemons with munge authentication, every file
# (config, state, spool, logs, PID files, munge socket) under one state directory, so two such
# clusters can run side by side on different ports and `stop` touches only what `start` began.
#
#   tools/slurm_local.sh install                        # apt-get the packages (root; idempotent)
#   tools/slurm_local.sh start [--nodes 1|2] [--port P] [--cpus N] DIR
#   export SLURM_CONF=DIR/slurm.conf                     # then sinfo / sbatch / srun as usual
#   tools/slurm_local.sh stop DIR
#
# --nodes 1 makes one node named `localhost`; --nodes 2 emulates a two-node cluster with two
# slurmd daemons named node1 and node2 on this host (NodeAddr 127.0.0.1, ports P+1 and P+2).
# DIR and its parents must be searchable by the `munge` user (munged runs as that user).
# Exit codes: 0 ok, 1 failure (the message names the daemon and its log), 2 bad usage.
set -euo pipefail

readonly DEFAULT_PORT=6817
readonly START_TIMEOUT_S=60
readonly STOP_TIMEOUT_S=15

log() { printf '[slurm_local] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
usage() {
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

cmd_install() {
  [[ $(id -u) -eq 0 ]] || die "install needs root (apt-get)"
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
    && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    log "slurm-wlm and munge already installed"
  else
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge
  fi
  if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    install -d -o munge -g munge -m 0700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  log "installed: $(dpkg-query -W -f='${Package} ${Version} ' slurm-wlm munge)"
}

# Memory (MB) each emulated node declares: 80% of this host's, so slurmd never reports less.
host_memory_mb() {
  awk '/^MemTotal:/ { printf "%d\n", $2 / 1024 * 0.8 }' /proc/meminfo
}

write_conf() {
  local dir=$1 nodes=$2 port=$3 cpus=$4 mem
  mem=$(host_memory_mb)
  cat >"$dir/slurm.conf" <<EOF
# Written by tools/slurm_local.sh: a private ${nodes}-node Slurm cluster on this host.
ClusterName=gspolocal
SlurmctldHost=localhost
SlurmctldPort=${port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${dir}/munge/munge.socket.2
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool/%n
SlurmctldPidFile=${dir}/slurmctld.pid
SlurmdPidFile=${dir}/slurmd.%n.pid
SlurmctldLogFile=${dir}/slurmctld.log
SlurmdLogFile=${dir}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,bf_hetjob_immediate,sched_interval=2
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobRequeue=1
ReturnToService=2
MailProg=/bin/true
KillWait=5
MinJobAge=600
EOF
  if [[ $nodes -eq 1 ]]; then
    cat >>"$dir/slurm.conf" <<EOF
SlurmdPort=$((port + 1))
NodeName=localhost NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
  else
    cat >>"$dir/slurm.conf" <<EOF
NodeName=node1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((port + 1)) CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
NodeName=node2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((port + 2)) CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
  fi
}

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
  local dir=$1
  if pid_alive "$dir/munge/munged.pid"; then return 0; fi
  install -d -o munge -g munge -m 0700 "$dir/munge"
  runuser -u munge -- test -x "$dir/munge" \
    || die "the munge user cannot reach $dir; use a directory whose parents are world-searchable"
  runuser -u munge -- /usr/sbin/munged --force \
    --socket="$dir/munge/munge.socket.2" --pid-file="$dir/munge/munged.pid" \
    --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" \
    || die "munged failed to start; see $dir/munge/munged.log"
  munge -n --socket="$dir/munge/munge.socket.2" | unmunge --socket="$dir/munge/munge.socket.2" >/dev/null \
    || die "munge credential round trip failed; see $dir/munge/munged.log"
}

node_names() {
  if [[ $1 -eq 1 ]]; then echo localhost; else echo node1 node2; fi
}

wait_idle() {
  local dir=$1 nodes=$2 deadline states
  deadline=$((SECONDS + START_TIMEOUT_S))
  while ((SECONDS < deadline)); do
    states=$(SLURM_CONF="$dir/slurm.conf" sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ' || true)
    if [[ $states == "idle " ]] \
      && [[ $(SLURM_CONF="$dir/slurm.conf" sinfo -h -N -o %N | wc -l) -eq $nodes ]]; then
      log "cluster up in $dir: $nodes node(s) idle (export SLURM_CONF=$dir/slurm.conf)"
      return 0
    fi
    sleep 0.5
  done
  die "nodes not idle after ${START_TIMEOUT_S}s (states: ${states:-none}); see $dir/slurmctld.log and $dir/slurmd.*.log"
}

cmd_start() {
  local nodes=1 port=$DEFAULT_PORT cpus=4 dir="" name
  while (($#)); do
    case $1 in
      --nodes) nodes=$2; shift 2 ;;
      --port) port=$2; shift 2 ;;
      --cpus) cpus=$2; shift 2 ;;
      -*) usage ;;
      *) dir=$1; shift ;;
    esac
  done
  [[ -n $dir ]] || usage
  [[ $nodes == 1 || $nodes == 2 ]] || die "--nodes must be 1 or 2, got '$nodes'"
  [[ $port =~ ^[0-9]+$ ]] || die "--port must be a number, got '$port'"
  [[ $(id -u) -eq 0 ]] || die "start needs root (the daemons run as root and munge)"
  command -v slurmctld >/dev/null || die "slurmctld not found; run: $0 install"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  mkdir -p "$dir/state" "$dir/spool"
  if [[ -e $dir/slurm.conf ]] && pid_alive "$dir/slurmctld.pid"; then
    log "already running in $dir"
  else
    write_conf "$dir" "$nodes" "$port" "$cpus"
  fi
  start_munge "$dir"
  export SLURM_CONF=$dir/slurm.conf
  if ! pid_alive "$dir/slurmctld.pid"; then
    /usr/sbin/slurmctld -c || die "slurmctld failed; see $dir/slurmctld.log"
  fi
  for name in $(node_names "$nodes"); do
    mkdir -p "$dir/spool/$name"
    if ! pid_alive "$dir/slurmd.$name.pid"; then
      /usr/sbin/slurmd -N "$name" || die "slurmd $name failed; see $dir/slurmd.$name.log"
    fi
  done
  wait_idle "$dir" "$nodes"
}

# TERM every process named by the given PID files at once (each slurm daemon takes 1-2 s to shut
# down), KILL whatever outlives STOP_TIMEOUT_S, and remove the PID files.
stop_pidfiles() {
  local file pid deadline pids=()
  for file in "$@"; do
    [[ -s $file ]] && pid=$(cat "$file") && kill -0 "$pid" 2>/dev/null && pids+=("$pid")
  done
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  deadline=$((SECONDS + STOP_TIMEOUT_S))
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      log "pid $pid ignored TERM for ${STOP_TIMEOUT_S}s; killing"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -f "$@"
}

cmd_stop() {
  local dir=${1:-}
  [[ -n $dir ]] || usage
  [[ -d $dir ]] || die "no such state directory: $dir"
  dir=$(cd "$dir" && pwd)
  if pid_alive "$dir/slurmctld.pid"; then
    # Every job of this private cluster was started through it: end them before the daemons.
    SLURM_CONF="$dir/slurm.conf" scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    sleep 0.5
  fi
  stop_pidfiles "$dir"/slurmd.*.pid "$dir/slurmctld.pid"
  stop_pidfiles "$dir/munge/munged.pid"
  log "stopped the cluster in $dir"
}

main() {
  local cmd=${1:-}
  [[ -n $cmd ]] || usage
  shift
  case $cmd in
    install) cmd_install "$@" ;;
    start) cmd_start "$@" ;;
    stop) cmd_stop "$@" ;;
    *) usage ;;
  esac
}

main "$@"

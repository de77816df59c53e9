#!/usr/bin/env bash
# A multi-node GPU run over plain ssh: one trainer process per host, all of the host's GPUs in it, started with
# the same config keys on every host plus its own place in the run (config.distributed.coordinator_address,
# num_processes, process_id). Each host needs this checkout, set up (scripts/setup.sh, then jax[cuda12] at the
# installed jax's version), at the same path: the processes compare config and code digests at start.
#
#   scripts/gpu/ssh.sh launch --hosts H0,H1,... [--coordinator ADDR] [--port 8476] [--remote-dir DIR] [--log RUN]
#                             [--env K=V]... [--ssh-option OPT]... [--dry-run] -- --config experiments/NAME.py ...
#   scripts/gpu/ssh.sh logs   --hosts ... [--log RUN]     follow every host's log, prefixed with its host name
#   scripts/gpu/ssh.sh stop   --hosts ... [--log RUN]     stop the run on every host
#
#   --hosts        ssh destinations ([user@]host), process i on the i-th; the first one is process 0
#   --coordinator  process 0's address as the other hosts reach it (default: the first host's name) and
#   --port         the coordinator's port (default 8476)
#   --remote-dir   the checkout on every host (default agentfly-jax, relative to the ssh login directory)
#   --log          the run's name: logs/RUN.log and logs/RUN.pid on each host (default train)
#   --env K=V      an environment variable for the trainer on every host (repeatable), e.g. NCCL_SOCKET_IFNAME=eth0
#   --ssh-option   passed to ssh as -o OPT (repeatable), e.g. StrictHostKeyChecking=accept-new
#   --dry-run      print the ssh commands instead of running them
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/scripts/multihost/common.sh"
action="${1:-}"
case "$action" in
  launch|logs|stop) shift ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) die "the first argument is launch, logs or stop (see --help)" ;;
esac
hosts="" coordinator="" port=8476 remote_dir="agentfly-jax" log_name="train" envs=() ssh_opts=(-o BatchMode=yes)
train_args=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --*=*) opt="$1"; shift; set -- "${opt%%=*}" "${opt#*=}" "$@" ;;
    --hosts) need_value "$@"; hosts="$2"; shift 2 ;;
    --coordinator) need_value "$@"; coordinator="$2"; shift 2 ;;
    --port) need_value "$@"; port="$2"; shift 2 ;;
    --remote-dir) need_value "$@"; remote_dir="$2"; shift 2 ;;
    --log) need_value "$@"; log_name="$2"; shift 2 ;;
    --env) need_value "$@"; envs+=("$2"); shift 2 ;;
    --ssh-option) need_value "$@"; ssh_opts+=(-o "$2"); shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; train_args=("$@"); break ;;
    *) die "unknown option $(shq "$1") (see --help)" ;;
  esac
done
IFS=, read -r -a host_list <<< "$hosts"
[ "${#host_list[@]}" -gt 0 ] || die "--hosts is required: a comma-separated list of ssh destinations"
[[ "$port" =~ ^[0-9]+$ ]] && [ "$port" -gt 0 ] && [ "$port" -lt 65536 ] || die "--port $port: a TCP port"
[[ "$log_name" =~ ^[A-Za-z0-9_.-]+$ ]] || die "--log $log_name: letters, digits, '.', '_' and '-' only"
coordinator="${coordinator:-${host_list[0]#*@}}"
[[ "$coordinator" == *:* ]] || coordinator="$coordinator:$port"
cd_remote="cd $(shq "$remote_dir") &&"

case "$action" in
  launch)
    [ "${#train_args[@]}" -gt 0 ] || die "give the trainer's arguments after --, e.g. -- --config experiments/quickstart.py"
    prefix="$(env_prefix ${envs[@]+"${envs[@]}"})"
    n="${#host_list[@]}"
    for i in "${!host_list[@]}"; do
      run ssh "${ssh_opts[@]}" "${host_list[$i]}" "$cd_remote ${prefix}bash scripts/multihost/worker.sh start $log_name \
-- $(shq "${train_args[@]}" "--config.distributed.coordinator_address=$coordinator" \
"--config.distributed.num_processes=$n" "--config.distributed.process_id=$i")"
    done
    note "follow the run: scripts/gpu/ssh.sh logs --hosts $hosts --log $log_name"
    ;;
  logs|stop)
    pids=()
    for host in "${host_list[@]}"; do
      run ssh "${ssh_opts[@]}" "$host" "$cd_remote bash scripts/multihost/worker.sh $action $log_name" &
      pids+=("$!")
    done
    status=0
    for pid in "${pids[@]}"; do
      wait "$pid" || status=$?
    done
    exit "$status"
    ;;
esac

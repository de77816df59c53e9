# shellcheck shell=bash
# Sourced by scripts/tpu/*.sh: the options every TPU script takes, and the gcloud scope they share.
#   --name NAME        the queued resource and its TPU node (both get this id)    [env TPU_NAME]
#   --zone ZONE        e.g. us-east5-a (v5p), us-east5-b (v6e)                     [env TPU_ZONE]
#   --project PROJECT  (optional: gcloud's configured project otherwise)          [env TPU_PROJECT]
#   --remote-dir DIR   the checkout on every worker, relative to its home         (default agentfly-jax)
#   --log NAME         the run's name on the workers: logs/NAME.log, logs/NAME.pid (default train)
#   --dry-run          print the gcloud commands instead of running them
# Options of the script itself are left in EXTRA, arguments after `--` in TRAIN_ARGS.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../multihost/common.sh
source "$ROOT/scripts/multihost/common.sh"
NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
PROJECT="${TPU_PROJECT:-}"
REMOTE_DIR="agentfly-jax"
LOG_NAME="train"
EXTRA=()
TRAIN_ARGS=()

parse_tpu_flags() {
  local args=() arg
  while [ "$#" -gt 0 ]; do  # --opt=value -> --opt value, up to `--`
    arg="$1"
    shift
    if [ "$arg" = "--" ]; then
      args+=(-- "$@")
      break
    elif [[ "$arg" == --*=* ]]; then
      args+=("${arg%%=*}" "${arg#*=}")
    else
      args+=("$arg")
    fi
  done
  set -- ${args[@]+"${args[@]}"}
  while [ "$#" -gt 0 ]; do
    case "$1" in
      --name) need_value "$@"; NAME="$2"; shift 2 ;;
      --zone) need_value "$@"; ZONE="$2"; shift 2 ;;
      --project) need_value "$@"; PROJECT="$2"; shift 2 ;;
      --remote-dir) need_value "$@"; REMOTE_DIR="$2"; shift 2 ;;
      --log) need_value "$@"; LOG_NAME="$2"; shift 2 ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
      --) shift; TRAIN_ARGS=("$@"); break ;;
      *) EXTRA+=("$1"); shift ;;
    esac
  done
  [ -n "$NAME" ] || die "--name is required (or TPU_NAME): the queued resource / TPU node"
  [ -n "$ZONE" ] || die "--zone is required (or TPU_ZONE)"
  [[ "$LOG_NAME" =~ ^[A-Za-z0-9_.-]+$ ]] || die "--log $LOG_NAME: letters, digits, '.', '_' and '-' only"
  SCOPE=("--zone=$ZONE")
  if [ -n "$PROJECT" ]; then
    SCOPE+=("--project=$PROJECT")
  fi
}

# on_workers WORKER COMMAND: COMMAND run by the workers' shells (WORKER: all, or a worker number)
on_workers() {
  run gcloud compute tpus tpu-vm ssh "$NAME" "${SCOPE[@]}" "--worker=$1" "--command=$2"
}

unknown_options() {
  [ "${#EXTRA[@]}" -eq 0 ] || die "unknown option(s): $(shq "${EXTRA[@]}") (see --help)"
}

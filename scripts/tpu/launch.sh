#!/usr/bin/env bash
# Starts the trainer on every worker of the slice at once, detached (it outlives this command), with the
# arguments after `--`. jax.distributed needs nothing more on a TPU slice: with config.distributed unset, every
# worker's process finds the coordinator (worker 0), the number of processes and its own id in the TPU metadata
# (agentfly_jax/trainer/distributed.py); the processes then check that they run the same config and code.
#
#   scripts/tpu/launch.sh --name NAME --zone ZONE [--project P] [--remote-dir DIR] [--log RUN] [--env K=V]...
#                         [--dry-run] -- --config experiments/NAME.py [--config.key=value ...]
#
#   --env K=V   an environment variable for the trainer on every worker (repeatable), e.g. LIBTPU_INIT_ARGS=...
# Output goes to DIR/logs/RUN.log on each worker: follow it with scripts/tpu/logs.sh, stop with scripts/tpu/stop.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_tpu_flags "$@"
envs=()
set -- ${EXTRA[@]+"${EXTRA[@]}"}
EXTRA=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --env) need_value "$@"; envs+=("$2"); shift 2 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
unknown_options
[ "${#TRAIN_ARGS[@]}" -gt 0 ] || die "give the trainer's arguments after --, e.g. -- --config experiments/quickstart.py"
prefix="$(env_prefix ${envs[@]+"${envs[@]}"})"
on_workers all "cd $(shq "$REMOTE_DIR") && ${prefix}bash scripts/multihost/worker.sh start $LOG_NAME -- \
$(shq "${TRAIN_ARGS[@]}")"
note "follow the run: scripts/tpu/logs.sh --name $NAME --zone $ZONE --log $LOG_NAME"

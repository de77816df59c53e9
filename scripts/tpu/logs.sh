#!/usr/bin/env bash
# Streams a run's log from the workers, from its first line on, each line prefixed with its worker's host name
# (Ctrl-C stops following; the run goes on).
#
#   scripts/tpu/logs.sh --name NAME --zone ZONE [--project P] [--remote-dir DIR] [--log RUN] [--worker N|all]
#                       [--dry-run]
#
#   --worker   which worker's log: a number (default 0: process 0 writes the run's metrics and summary) or all
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_tpu_flags "$@"
worker=0
set -- ${EXTRA[@]+"${EXTRA[@]}"}
EXTRA=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --worker) need_value "$@"; worker="$2"; shift 2 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
unknown_options
[[ "$worker" =~ ^([0-9]+|all)$ ]] || die "--worker $worker: a worker number or all"
on_workers "$worker" "cd $(shq "$REMOTE_DIR") && bash scripts/multihost/worker.sh logs $LOG_NAME"

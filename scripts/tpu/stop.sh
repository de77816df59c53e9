#!/usr/bin/env bash
# Stops a run on every worker (SIGTERM to the trainer's process group, SIGKILL after 30 s); the slice stays up.
#
#   scripts/tpu/stop.sh --name NAME --zone ZONE [--project P] [--remote-dir DIR] [--log RUN] [--dry-run]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_tpu_flags "$@"
unknown_options
on_workers all "cd $(shq "$REMOTE_DIR") && bash scripts/multihost/worker.sh stop $LOG_NAME"

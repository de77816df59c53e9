#!/usr/bin/env bash
# Deletes the queued resource and its TPU node (--force: running workers included; their disks go with them, so
# copy results off first, or write the workdir to a bucket).
#
#   scripts/tpu/teardown.sh --name NAME --zone ZONE [--project P] [--dry-run]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_tpu_flags "$@"
unknown_options
run gcloud compute tpus queued-resources delete "$NAME" "${SCOPE[@]}" --force --quiet

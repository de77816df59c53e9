#!/usr/bin/env bash
# Creates a TPU pod slice as a queued resource and waits until it is ACTIVE (its workers are up).
#
#   scripts/tpu/create.sh --name NAME --zone ZONE --accelerator TYPE [--runtime VERSION] [--project P]
#                         [--spot | --reserved] [--poll SECONDS] [--wait-timeout SECONDS] [--no-wait] [--dry-run]
#
#   --accelerator   e.g. v5p-32 (32 TensorCores: 16 chips on 4 hosts), v6e-32 (32 chips)
#   --runtime       the TPU VM software version; by default the one for JAX on that generation:
#                   v6e v2-alpha-tpuv6e, v5p v2-alpha-tpuv5, v5e (v5litepod) v2-alpha-tpuv5-lite,
#                   v4 tpu-ubuntu2204-base
#   --spot / --reserved   the capacity to queue for (default: on-demand)
#   --poll, --wait-timeout   seconds between state checks (30) and in all (86400); --no-wait returns at once
# Common options (--name, --zone, --project, --dry-run): scripts/tpu/common.sh. Next: scripts/tpu/setup.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_tpu_flags "$@"
accelerator="" runtime="" capacity=() poll=30 wait_timeout=86400 wait=1
set -- ${EXTRA[@]+"${EXTRA[@]}"}
EXTRA=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --accelerator) need_value "$@"; accelerator="$2"; shift 2 ;;
    --runtime) need_value "$@"; runtime="$2"; shift 2 ;;
    --spot|--reserved) capacity=("$1"); shift ;;
    --poll) need_value "$@"; poll="$2"; shift 2 ;;
    --wait-timeout) need_value "$@"; wait_timeout="$2"; shift 2 ;;
    --no-wait) wait=0; shift ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
unknown_options
[ -n "$accelerator" ] || die "--accelerator is required, e.g. v5p-32 or v6e-32"
if [ -z "$runtime" ]; then
  case "$accelerator" in
    v6e-*) runtime="v2-alpha-tpuv6e" ;;
    v5p-*) runtime="v2-alpha-tpuv5" ;;
    v5litepod-*) runtime="v2-alpha-tpuv5-lite" ;;
    v4-*) runtime="tpu-ubuntu2204-base" ;;
    *) die "no default --runtime for --accelerator $accelerator: pass the TPU software version" ;;
  esac
fi
[[ "$poll" =~ ^[0-9]+$ && "$wait_timeout" =~ ^[0-9]+$ ]] || die "--poll and --wait-timeout take whole seconds"

run gcloud compute tpus queued-resources create "$NAME" "--node-id=$NAME" "${SCOPE[@]}" \
  "--accelerator-type=$accelerator" "--runtime-version=$runtime" ${capacity[@]+"${capacity[@]}"}
[ "$wait" = 1 ] || exit 0
describe=(gcloud compute tpus queued-resources describe "$NAME" "${SCOPE[@]}" "--format=value(state.state)")
if [ "$DRY_RUN" = 1 ]; then
  note "then, every ${poll} s until the state is ACTIVE:"
  run "${describe[@]}"
  exit 0
fi
deadline=$(( $(date +%s) + wait_timeout ))
while true; do
  state="$("${describe[@]}")"
  case "$state" in
    ACTIVE) note "$NAME is ACTIVE: set its workers up with scripts/tpu/setup.sh --name $NAME --zone $ZONE"; exit 0 ;;
    FAILED|SUSPENDED) die "queued resource $NAME is $state: see gcloud compute tpus queued-resources describe $NAME $(shq "${SCOPE[@]}"); delete it with scripts/tpu/teardown.sh" ;;
  esac
  if [ "$(date +%s)" -ge "$deadline" ]; then
    die "queued resource $NAME still ${state:-unknown} after ${wait_timeout} s (it stays queued: check again, or scripts/tpu/teardown.sh)"
  fi
  note "$NAME is ${state:-unknown}; checking again in ${poll} s"
  sleep "$poll"
done

#!/usr/bin/env bash
# Starts a Docker daemon where none answers, installing docker.io first when dockerd is missing. Idempotent:
# with a daemon already running it only checks. Needs root (it starts dockerd itself; there is no systemd).
#   DOCKERD_LOG=path   where the daemon logs (default /var/log/agentfly-dockerd.log)
set -euo pipefail
log() { printf '[start_docker] %s\n' "$*" >&2; }

if docker info >/dev/null 2>&1; then
  log "Docker daemon already running"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  log "no Docker daemon answers and starting one needs root; run this script as root"
  exit 1
fi
if ! command -v dockerd >/dev/null 2>&1; then
  log "installing docker.io"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
fi

LOG="${DOCKERD_LOG:-/var/log/agentfly-dockerd.log}"
mkdir -p "$(dirname "$LOG")"
# setsid: the daemon must outlive this script and the test run that called it.
setsid dockerd >"$LOG" 2>&1 < /dev/null &
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then
    log "Docker daemon started (log: $LOG)"
    exit 0
  fi
  sleep 0.5
done
log "dockerd did not come up within 30 s; last lines of $LOG:"
tail -n 20 "$LOG" >&2 || true
exit 1

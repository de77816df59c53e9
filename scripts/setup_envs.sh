#!/usr/bin/env bash
# Sets up what the environments on real engines need beyond Python packages, idempotently:
#   - bfcl-eval==2026.3.23 (the BFCL multi-turn data and executable backends of environments/bfcl), installed
#     with --no-deps into the project's Python: it pins numpy 1.26 and many API clients, of which the eight
#     multi-turn backends and the data files need only mpmath (math_api), pinned here too;
#   - Java 17 (Debian's openjdk-17-jre-headless) for ScienceWorld's simulator, installed with apt-get when
#     `java` is missing or older than 17.
# The other Python packages (scienceworld, alfworld, textworld[pddl]) are the `envs` extra, installed by setup.sh.
# Needs root to install Java; without root it says what is missing and exits 0 (the ScienceWorld tests then
# fail with that message). PYTHON (default: .venv/bin/python of this checkout) is the interpreter to install into.
set -euo pipefail
log() { printf '[setup_envs] %s\n' "$*" >&2; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
BFCL_EVAL_VERSION=2026.3.23
MPMATH_VERSION=1.3.0
if [ -x "$PYTHON" ]; then
  have="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("bfcl-eval"))' 2>/dev/null || true)"
  if [ "$have" = "$BFCL_EVAL_VERSION" ]; then
    log "bfcl-eval $have present"
  else
    log "installing bfcl-eval==$BFCL_EVAL_VERSION (--no-deps)"
    "$PYTHON" -m pip install -q --no-deps "bfcl-eval==$BFCL_EVAL_VERSION"
  fi
  if ! "$PYTHON" -c 'import mpmath' 2>/dev/null; then
    log "installing mpmath==$MPMATH_VERSION (--no-deps)"
    "$PYTHON" -m pip install -q --no-deps "mpmath==$MPMATH_VERSION"
  fi
else
  log "no Python at $PYTHON: skipping bfcl-eval (set PYTHON=... to install it)"
fi

java_major() {
  command -v java >/dev/null 2>&1 || { echo 0; return; }
  java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1
}

major="$(java_major)"
if [ "${major:-0}" -ge 17 ]; then
  log "java $major present"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  log "Java 17 is missing (found: ${major:-none}) and this is not root: install openjdk-17-jre-headless"
  exit 0
fi
log "installing openjdk-17-jre-headless"
apt-get update -qq
# The JRE's post-install scripts expect the man directories Debian's slim images leave out.
mkdir -p /usr/share/man/man1
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openjdk-17-jre-headless >/dev/null
log "java $(java_major) installed"

#!/usr/bin/env bash
# Sets up what the environments on real engines need beyond Python packages, idempotently:
#   - Java 17 (Debian's openjdk-17-jre-headless) for ScienceWorld's simulator, installed with apt-get when
#     `java` is missing or older than 17.
# The Python packages (scienceworld, alfworld, textworld[pddl]) are the `envs` extra, installed by setup.sh.
# Needs root to install Java; without root it says what is missing and exits 0 (the ScienceWorld tests then
# fail with that message).
set -euo pipefail
log() { printf '[setup_envs] %s\n' "$*" >&2; }

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

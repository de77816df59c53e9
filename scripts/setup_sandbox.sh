#!/usr/bin/env bash
# Sets up the code sandboxes (agentfly_jax.envs.sandbox), idempotently; a second run only checks.
#   - bubblewrap + util-linux (setpriv, prlimit) and docker.io, installed with apt-get only when missing;
#   - the unprivileged sandbox users agentfly-sb000.. (one uid per concurrent bwrap sandbox), when missing;
#   - a Docker daemon (scripts/start_docker.sh) and the sandbox image (scripts/build_sandbox_image.sh).
# Needs root. Without root it says what is missing and exits 0: the docker tests then fail with that message.
#   SANDBOX_SLOTS=N       number of sandbox users (default 128)
#   SANDBOX_UID_BASE=U    uid of the first one (default 420000; the group agentfly-sb gets gid U)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SLOTS="${SANDBOX_SLOTS:-128}"
UID_BASE="${SANDBOX_UID_BASE:-420000}"
log() { printf '[setup_sandbox] %s\n' "$*" >&2; }
start=$(date +%s)

if [ "$(id -u)" != 0 ]; then
  log "not root: skipping sandbox setup (the bwrap and docker backends need it run as root)"
  exit 0
fi

missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
{ command -v setpriv && command -v prlimit; } >/dev/null 2>&1 || missing+=(util-linux)
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! getent group agentfly-sb >/dev/null; then
  groupadd --gid "$UID_BASE" agentfly-sb
fi
created=0
for i in $(seq 0 $((SLOTS - 1))); do
  name="$(printf 'agentfly-sb%03d' "$i")"
  if ! getent passwd "$name" >/dev/null; then
    # Outside the login range on purpose (useradd warns about that); no home, no shell, no password.
    useradd -M -N -g agentfly-sb -d /nonexistent -s /usr/sbin/nologin -u $((UID_BASE + i)) "$name" \
      2>/dev/null \
      || { log "could not create user $name (uid $((UID_BASE + i)) taken?); set SANDBOX_UID_BASE"; exit 1; }
    created=$((created + 1))
  fi
done
[ "$created" -gt 0 ] && log "created $created sandbox users"

bash "$ROOT/scripts/start_docker.sh"
bash "$ROOT/scripts/build_sandbox_image.sh"
log "sandboxes ready in $(( $(date +%s) - start )) s"

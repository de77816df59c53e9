#!/usr/bin/env bash
# Copies this checkout (tracked and untracked files that git does not ignore) to every worker of the slice and
# sets each one up with the repository's own scripts/setup.sh plus jax[tpu], then checks that jax.distributed
# starts across all workers (scripts/multihost/worker.sh install --tpu). Every worker gets the same files, so the
# code digest that processes compare at start (agentfly_jax/trainer/distributed.py) is the same everywhere.
#
#   scripts/tpu/setup.sh --name NAME --zone ZONE [--project P] [--remote-dir DIR] [--dry-run]
#
# Run it again after changing the code: the checkout on the workers is replaced (.venv/, .cache/, logs/, runs/
# kept). Common options: scripts/tpu/common.sh. Next: scripts/tpu/launch.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_tpu_flags "$@"
unknown_options
[[ "$REMOTE_DIR" =~ ^[A-Za-z0-9_./-]+$ ]] || die "--remote-dir $REMOTE_DIR: a plain relative or absolute path"
archive="agentfly-jax-$NAME.tar.gz"
unpacked="$REMOTE_DIR.incoming"
local_dir="$(mktemp -d)"
trap 'rm -rf "$local_dir"' EXIT
if [ "$DRY_RUN" = 1 ]; then
  note "pack this checkout: git ls-files -z --cached --others --exclude-standard | tar --null -T - -czf $local_dir/$archive"
elif git -C "$ROOT" rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
     | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
     | tar --null -T - -czf "$local_dir/$archive")
else  # not a git checkout: everything but environments, caches and outputs
  tar -C "$ROOT" --exclude=./.git --exclude=./.venv --exclude=./.venv-vllm --exclude=./.cache --exclude=./runs \
    --exclude=./logs --exclude=__pycache__ -czf "$local_dir/$archive" .
  note "packed $(du -h "$local_dir/$archive" | cut -f1) from $ROOT"
fi
run gcloud compute tpus tpu-vm scp "$local_dir/$archive" "$NAME:$archive" "${SCOPE[@]}" --worker=all
on_workers all "set -e; rm -rf $unpacked; mkdir -p $unpacked; tar -xzf $archive -C $unpacked; rm -f $archive; \
bash $unpacked/scripts/multihost/worker.sh install $REMOTE_DIR --tpu"

#!/usr/bin/env bash
# Builds the Docker image the sandbox's docker backend runs code in, without any registry: the host's system
# Python (binary, standard library, the shared libraries they link) is packed into a root filesystem tarball
# and loaded with `docker import`. No shell, no package manager, no compilers inside: only python3.
#
#   bash scripts/build_sandbox_image.sh           # builds only if the image is missing
#   bash scripts/build_sandbox_image.sh --force   # rebuilds
#   SANDBOX_IMAGE=name:tag bash scripts/build_sandbox_image.sh
#
# Needs a running Docker daemon (scripts/start_docker.sh) and /usr/bin/python3 on the host.
set -euo pipefail

IMAGE="${SANDBOX_IMAGE:-agentfly-jax-sandbox:1}"
PYTHON="${SANDBOX_PYTHON:-/usr/bin/python3}"
log() { printf '[build_sandbox_image] %s\n' "$*" >&2; }

if [ "${1:-}" != "--force" ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "image $IMAGE already exists"
  exit 0
fi
if ! docker info >/dev/null 2>&1; then
  log "no Docker daemon answers; start one with scripts/start_docker.sh (as root)"
  exit 1
fi
if [ ! -x "$PYTHON" ]; then
  log "$PYTHON not found; install python3 (apt-get install python3) or set SANDBOX_PYTHON"
  exit 1
fi

start=$(date +%s)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The rootfs is written as a tar stream by the host Python itself (tarfile), so nothing on the host changes.
"$PYTHON" - "$work/rootfs.tar" <<'EOF'
import glob
import io
import os
import subprocess
import sys
import sysconfig
import tarfile

out = sys.argv[1]
python = os.path.realpath(sys.executable)
stdlib = sysconfig.get_paths()["stdlib"]
dynload = os.path.join(stdlib, "lib-dynload")
SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data"}


def canonical(path):
    # Same file name, directory resolved (so /lib/x/libz.so.1 lands in /usr/lib/x when /lib -> usr/lib).
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def needed_libraries(binaries):
    libs = set()
    for binary in binaries:
        text = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
        for line in text.splitlines():
            parts = line.split()
            if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
                libs.add(parts[2])
            elif parts and parts[0].startswith("/"):
                libs.add(parts[0])  # the dynamic loader
    return libs


added = set()
with tarfile.open(out, "w") as tar:
    def add_dir(path, mode=0o755):
        if path in added:
            return
        info = tarfile.TarInfo(path.lstrip("/"))
        info.type, info.mode = tarfile.DIRTYPE, mode
        tar.addfile(info)
        added.add(path)

    def add_parents(path):
        parts = os.path.dirname(path).strip("/").split("/")
        for i in range(1, len(parts) + 1):
            if parts[0]:
                add_dir("/" + "/".join(parts[:i]))

    def add_file(src, dest=None):
        dest = canonical(dest or src)
        if dest in added:
            return
        add_parents(dest)
        info = tar.gettarinfo(os.path.realpath(src), arcname=dest.lstrip("/"))
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        with open(os.path.realpath(src), "rb") as f:
            tar.addfile(info, f)
        added.add(dest)

    def add_symlink(path, target):
        info = tarfile.TarInfo(path.lstrip("/"))
        info.type, info.linkname = tarfile.SYMTYPE, target
        tar.addfile(info)
        added.add(path)

    def add_text(path, text, mode=0o644):
        add_parents(path)
        data = text.encode()
        info = tarfile.TarInfo(path.lstrip("/"))
        info.size, info.mode = len(data), mode
        tar.addfile(info, io.BytesIO(data))

    # Mirror the host's merged-/usr layout (bin -> usr/bin, ...) so the ELF interpreter path resolves.
    for top in ("bin", "sbin", "lib", "lib32", "lib64"):
        if os.path.islink("/" + top):
            add_symlink("/" + top, os.readlink("/" + top))
    add_file(python)
    version = os.path.basename(python)
    add_symlink("/usr/bin/python3", version)
    for root, dirs, files in os.walk(stdlib):
        rel = os.path.relpath(root, stdlib)
        dirs[:] = [d for d in dirs if not (rel == "." and (d in SKIP or d.startswith("config-")))]
        for name in files:
            add_file(os.path.join(root, name))
    for lib in needed_libraries([python, *glob.glob(os.path.join(dynload, "*.so"))]):
        add_file(lib)
    if os.path.exists("/etc/ld.so.cache"):
        add_file("/etc/ld.so.cache")
    add_text("/etc/passwd", "root:x:0:0:root:/root:/usr/sbin/nologin\n"
                            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    add_text("/etc/group", "root:x:0:\nnogroup:x:65534:\n")
    for path, mode in (("/tmp", 0o1777), ("/dev", 0o755), ("/proc", 0o755), ("/sys", 0o755)):
        add_dir(path, mode)
print(f"rootfs: {len(added)} entries", file=sys.stderr)
EOF

docker import \
  --change 'USER 65534:65534' \
  --change 'WORKDIR /tmp' \
  --change 'ENV PATH=/usr/bin:/bin HOME=/tmp LANG=C.UTF-8' \
  --change 'LABEL org.agentfly-jax.sandbox-image=1' \
  --message "agentfly-jax sandbox: $("$PYTHON" --version 2>&1)" \
  "$work/rootfs.tar" "$IMAGE" >/dev/null

# Smoke check: the image runs Python as nobody, without network.
docker run --rm --network none "$IMAGE" \
  python3 -I -c 'import os, ssl, sqlite3, json; assert os.getuid() == 65534'
size="$(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
log "built $IMAGE ($size) in $(( $(date +%s) - start )) s"

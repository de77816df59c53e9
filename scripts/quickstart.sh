#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh, idempotent) and runs the main job: the CPU quickstart experiment
# (SFT warm start, then RL teaches a tiny agent to use its calculator; offline, a few minutes on 2 cores).
# Extra arguments go to the trainer, e.g. --config.algorithm=ppo.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec .venv/bin/python -m agentfly_jax.train --config experiments/quickstart.py "$@"

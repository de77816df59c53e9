#!/usr/bin/env bash
# A multi-node GPU run under SLURM: `srun` starts one trainer process per node (all of the node's GPUs in it),
# each given the same config keys as a plain-ssh launch: config.distributed.coordinator_address (the job's first
# node, from scontrol), num_processes ($SLURM_NTASKS) and process_id ($SLURM_PROCID), set inside each task.
# The checkout (set up: scripts/setup.sh, then jax[cuda12] at the installed jax's version) must be on a
# filesystem every node sees. Run it inside an allocation (sbatch, salloc) or let srun make one.
#
#   scripts/gpu/srun.sh [--nodes N] [--port 8476] [--srun-option OPT]... [--dry-run] \
#                       -- --config experiments/NAME.py [--config.key=value ...]
#
#   --nodes         nodes (default: the allocation's, $SLURM_JOB_NUM_NODES)
#   --port          the coordinator's port on the first node (default 8476)
#   --srun-option   passed to srun (repeatable), e.g. --srun-option=--gpus-per-node=8 --srun-option=--partition=a100
#   --dry-run       print the srun command instead of running it
# Output: srun's own, each line labelled with its task (process) id. PYTHON (default: this checkout's
# .venv/bin/python) is the interpreter on the nodes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/scripts/multihost/common.sh"
nodes="${SLURM_JOB_NUM_NODES:-}" port=8476 srun_opts=() train_args=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --*=*) opt="$1"; shift; set -- "${opt%%=*}" "${opt#*=}" "$@" ;;
    --nodes) need_value "$@"; nodes="$2"; shift 2 ;;
    --port) need_value "$@"; port="$2"; shift 2 ;;
    --srun-option) need_value "$@"; srun_opts+=("$2"); shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; train_args=("$@"); break ;;
    *) die "unknown option $(shq "$1") (see --help)" ;;
  esac
done
[[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "--nodes is required outside an allocation (a positive number)"
[[ "$port" =~ ^[0-9]+$ ]] && [ "$port" -gt 0 ] && [ "$port" -lt 65536 ] || die "--port $port: a TCP port"
[ "${#train_args[@]}" -gt 0 ] || die "give the trainer's arguments after --, e.g. -- --config experiments/quickstart.py"
python="${PYTHON:-$ROOT/.venv/bin/python}"
# runs in every task: the SLURM variables are the task's own; the trainer's arguments arrive as "$@"
# (one line, so that --dry-run prints one command per line; expanded by the task's shell, not here)
# shellcheck disable=SC2016
task='head="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"; cd '"$(shq "$ROOT")"' && exec env '\
'PYTHONUNBUFFERED=1 '"$(shq "$python")"' -m agentfly_jax.train "$@" --config.distributed.coordinator_address='\
'"$head:'"$port"'" --config.distributed.num_processes="$SLURM_NTASKS" --config.distributed.process_id="$SLURM_PROCID"'
run srun "--nodes=$nodes" --ntasks-per-node=1 --label ${srun_opts[@]+"${srun_opts[@]}"} \
  bash -c "$task" agentfly-task "${train_args[@]}"

"""Benchmark: asynchronous off-policy training against the synchronous loop on a long-tail agent workload.

    python scripts/bench_async.py                       # 12 steps x 16 tasks x 4 chains, staleness 0 vs 2
    python scripts/bench_async.py --steps 5 --tasks 4 --chains 2 --generation 0.1 --long-turns 5 --tail-every 2
                                                        # the short version CI runs (a test)

Workload: the quickstart's arithmetic task, trained by the real trainer loop (`agentfly_jax.trainer.loop.train`:
GRPO, the real jitted update of the quickstart's tiny model, weight sync, metrics), with the rollout's model
replaced by the scripted FAKE backend of the tests (tests/rollout/fakes.py: it returns real token ids of the task's
tokenizer after an asyncio.sleep of `--generation` seconds per turn). The script gives the workload a long tail:
the chains of one task in `--tail-every` write `--long-turns` calculator calls before answering, the others one
— so every step's rollout waits for a few chains many turns longer than the rest, as in agentic RL.

With `--experiment experiments/smollm2_search.py` (a GPU machine) the workload is a real recipe instead: its
model on the JAX sampler, its environment, tools and lengths (SFT warm start included, evaluations off), and with
`--separate-device` the asynchronous runs put the sampler on one GPU and the trainer on the others, against the
synchronous loop on all of them:

    python scripts/bench_async.py --experiment experiments/smollm2_search.py --steps 12 --separate-device

Measured: trajectories per second over the RL steps after the first max(1, max_staleness) — the first step's
compile and the head start of the batches an asynchronous run rolls out before its first update excluded — for
`rl.max_staleness=0` (the synchronous loop) and each `--staleness` value, in one invocation, on the same
workload; the ratio is asynchronous / synchronous. Prints one JSON line per mode and a summary line.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from agentfly_jax.trainer import builders, loop
from experiments import quickstart
from tests.rollout.fakes import FakePrompt, FakeScriptedBackend


def long_tail_script(long_turns: int, tail_every: int, seed: int = 0):
    """The scripted agent: a chain of a "long" task (one in `tail_every`, by its question) calls the calculator
    `long_turns` times, other chains once; then it answers, right half of the time (so groups have signal)."""
    rng = random.Random(seed)

    def script(prompt: FakePrompt) -> str:
        digits = "".join(ch for ch in prompt.question if ch.isdigit())
        calls = long_turns if int(digits or 0) % tail_every == 0 else 1
        expression = prompt.question.removeprefix("What is ").rstrip("?").strip() or "1 + 1"
        if prompt.turn < calls:
            return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + expression + '"}}</tool_call>'
        result = prompt.text.rsplit("<tool_response>", 1)[-1].split("</tool_response>", 1)[0].strip()
        return "The answer is " + (result if rng.random() < 0.5 else "0")

    return script


def config(args, staleness: int, workdir: str):
    c = quickstart.get_config()
    c.workdir = workdir
    c.progress = False
    c.sft.stages = ()  # the scripted backend needs no warm start
    c.eval.update({"num_tasks": 0, "every": 0, "sampled_chains": 0})
    c.task.num_eval = 0
    c.checkpoint.every = 0
    c.rl.update({"steps": args.steps, "tasks_per_step": args.tasks, "chains_per_task": args.chains,
                 "max_staleness": staleness, "partial_rollouts": bool(staleness and args.partial)})
    c.loss.is_cap = 2.0
    c.agent.update({"max_turns": args.long_turns + 1, "max_context_tokens": 448, "max_new_tokens": 48})
    c.jax_sampler.max_len = None  # the context's (the scripted backend stands in for the sampler)
    c.seq_buckets = (128, 256, 512)
    return c


@contextlib.contextmanager
def scripted_training(make_backend):
    """While open, `loop.train` rolls out with `make_backend(tokenizer)` instead of the configured backend (None:
    the configured one), and the end of every weight sync is timed into the yielded list."""
    marks: list[float] = []
    tokenizers = []
    saved = builders.build_tokenizer, builders.build_backend, loop.sync_weights

    def build_tokenizer(*a, **k):
        tokenizers.append(saved[0](*a, **k))
        return tokenizers[-1]

    def build_backend(cfg, model, params, workdir=None):
        if make_backend is None:  # the configured backend (a real model)
            return saved[1](cfg, model, params, workdir)
        return make_backend(tokenizers[-1])

    def sync_weights(run, version):
        seconds = saved[2](run, version)
        marks.append(time.perf_counter())
        return seconds

    builders.build_tokenizer, builders.build_backend, loop.sync_weights = build_tokenizer, build_backend, sync_weights
    try:
        yield marks
    finally:
        builders.build_tokenizer, builders.build_backend, loop.sync_weights = saved


def experiment_config(args, staleness: int, workdir: str):
    """`--experiment path.py[:arg]` (a real model on the JAX sampler) for `--steps` RL steps, without evaluations;
    asynchronous runs with `--separate-device` put the sampler on its own device (the synchronous run shares
    every device between the mesh and the sampler)."""
    path, _, arg = args.experiment.partition(":")
    spec = importlib.util.spec_from_file_location("bench_experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config(arg or None)
    c.workdir, c.progress = workdir, False
    c.eval.update({"num_tasks": 0, "every": 0, "before_sft": False, "sampled_chains": 0})
    c.checkpoint.every = 0
    c.rl.update({"steps": args.steps, "max_staleness": staleness,
                 "partial_rollouts": bool(staleness and args.partial)})
    if staleness:
        c.loss.is_cap = c.loss.is_cap or 2.0
        c.jax_sampler.separate_device = bool(args.separate_device)
    return c


def run_mode(args, staleness: int, skip: int) -> dict:
    """One training run; trajectories/s over the steps after the first `skip` (timed from the end of step `skip`
    to the end of the last step)."""
    def make_backend(tokenizer):
        return FakeScriptedBackend(tokenizer, long_tail_script(args.long_turns, args.tail_every),
                                   latency_s=args.generation, report_weight_version=True)

    real = bool(args.experiment)
    with scripted_training(None if real else make_backend) as marks, tempfile.TemporaryDirectory() as workdir:
        loop.train((experiment_config if real else config)(args, staleness, workdir))
        with open(os.path.join(workdir, "tensorboard", "metrics.jsonl")) as fh:
            rows = [json.loads(line) for line in fh]
    steps = [r for r in rows if "reward/mean" in r]
    marks = marks[-args.steps:]  # one sync per RL step (a warm start's SFT adds one before them)
    if len(marks) != args.steps or len(steps) != args.steps:
        raise RuntimeError(f"expected {args.steps} steps, saw {len(marks)} weight syncs and {len(steps)} rows")
    timed = steps[skip:]
    trajectories = sum(r["rollout/chains"] for r in timed)
    seconds = marks[-1] - marks[skip - 1]
    turns = [r["rollout/turns_per_chain"] for r in steps]
    out = {"mode": "sync" if not staleness else f"async_staleness_{staleness}", "max_staleness": staleness,
           "partial_rollouts": bool(staleness and args.partial), "steps_timed": len(timed),
           "trajectories": trajectories, "seconds": round(seconds, 3),
           "trajectories_per_s": round(trajectories / seconds, 2),
           "rollout_s_mean": round(sum(r["time/rollout_s"] for r in timed) / len(timed), 3),
           "update_s_mean": round(sum(r["time/update_s"] for r in timed) / len(timed), 3),
           "turns_per_chain_mean": round(sum(turns) / len(turns), 2)}
    if staleness:
        out["staleness_mean"] = round(sum(r["async/staleness_mean"] for r in steps) / len(steps), 2)
        out["staleness_max"] = max(r["async/staleness_max"] for r in steps)
        out["trainer_wait_s_mean"] = round(sum(r["async/trainer_wait_s"] for r in timed) / len(timed), 3)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--generation", type=float, default=0.25, help="seconds a scripted turn takes")
    parser.add_argument("--long-turns", type=int, default=8, help="calculator calls of a long-tail chain")
    parser.add_argument("--tail-every", type=int, default=8, help="one task in this many is a long one")
    parser.add_argument("--staleness", default="2", help="comma-separated max_staleness values to compare")
    parser.add_argument("--partial", action="store_true", help="asynchronous runs with rl.partial_rollouts")
    parser.add_argument("--experiment", default="",
                        help="a real model instead of the scripted workload: an experiment file[:arg], e.g. "
                             "experiments/smollm2_search.py (its own tasks, chains and lengths; a GPU machine)")
    parser.add_argument("--separate-device", action="store_true",
                        help="with --experiment: asynchronous runs put the sampler on the last device")
    args = parser.parse_args(argv)
    stalenesses = [int(v) for v in args.staleness.split(",")]
    # every mode is timed over the same steps: after the first (it compiles) and after the first max_staleness
    # ones, which an asynchronous run rolls out ahead during the first update (a head start, not throughput)
    skip = max(1, *stalenesses)
    if args.steps < skip + 2:
        parser.error(f"--steps must be >= {skip + 2}: the first {skip} steps are not timed")
    results = [run_mode(args, 0, skip)]
    print(json.dumps(results[0]), flush=True)
    for staleness in stalenesses:
        results.append(run_mode(args, staleness, skip))
        print(json.dumps(results[-1]), flush=True)
    base = results[0]["trajectories_per_s"]
    import jax

    devices = jax.devices()
    machine = (f"{len(devices)} x {devices[0].device_kind}" if devices[0].platform == "gpu"
               else f"{platform.machine()} CPU x{os.cpu_count()}")
    workload = vars(args)
    if args.experiment:  # the recipe sets tasks, chains and lengths; the scripted workload's knobs do not apply
        workload = {k: workload[k] for k in ("experiment", "steps", "staleness", "partial", "separate_device")}
    summary = {"machine": machine, "workload": workload,
               "speedup": {r["mode"]: round(r["trajectories_per_s"] / base, 2) for r in results[1:]}}
    print(json.dumps(summary), flush=True)
    return {"results": results, **summary}


if __name__ == "__main__":
    main()

"""Benchmark: how close the asynchronous rollout gets to its critical path, against running tools one by one.

    python scripts/bench_rollout_overlap.py                          # 64 chains x 3 turns x 3 calls of 0.2 s
    python scripts/bench_rollout_overlap.py --chains 256             # the figure in docs/benchmarks.md
    python scripts/bench_rollout_overlap.py --chains 16 --turns 2    # the short version CI runs (a test)

Workload: `--chains` chains (16 tasks x 4 chains by default), each with `--turns` assistant turns; every turn
writes `--calls` `<tool_call>`s of a tool that sleeps `--tool-sleep` seconds, and sampling a turn takes
`--generation` seconds. The "model" is the scripted fake backend of the tests (tests/rollout/fakes.py): it
returns real Qwen2.5 token ids after an asyncio.sleep, so what is measured is the rollout runtime itself
(template encoding, parsing, tool dispatch, bookkeeping) around the waits.

The critical path of one chain is turns x (generation + tool sleep): no runtime can beat it. The report
gives wall time / critical path for the runtime as it is (tool calls of a turn concurrent, chains
independent; target <= 1.10 at 256 chains) and for the same workload with each turn's tools run one after
another. Prints a JSON line per mode and a summary.

Garbage collection: each run starts from a full collection (nothing left over from setting up counts
against it), and its JSON line gives the process CPU time it used (`cpu_s`), the time spent in garbage
collections (`gc_s`) and how many were full ones (`full_collections`). A full collection walks every object
of the process: here about 280,000 from the imports (transformers, jax, torch), some 0.15-0.25 s on a slow
CPU, and every 256-chain rollout set one off until the runtime's allocations were cut (docs/benchmarks.md); a
trainer's steps make more between rollouts and still do. The trainer freezes the objects that exist
once it is set up out of the collector's reach (`agentfly_jax.heap.freeze_startup_heap`: `gc.collect()` then
`gc.freeze()`), so that only what the steps make is walked; this script does the same once the tokenizer is
built, so that it measures the runtime as the trainer runs it. `--no-gc-freeze` leaves the heap as the
process has it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from agentfly_jax.heap import freeze_startup_heap, unfreeze_startup_heap
from agentfly_jax.rollout.agents import ToolCallingAgent
from agentfly_jax.tools import tool
from tests.rollout.fakes import FakeScriptedBackend, tool_call_text

CHAINS_PER_TASK = 4


def run_overlap_benchmark(
    tokenizer: Any,
    *,
    chains: int = 64,
    turns: int = 3,
    calls: int = 3,
    tool_sleep_s: float = 0.2,
    generation_s: float = 0.1,
    parallel_tool_calls: bool = True,
) -> dict[str, Any]:
    """Run the workload once; returns wall time, critical path, their ratio, CPU and GC time and the stats."""

    @tool(name="slow_tool")
    async def slow_tool(key: str) -> str:
        """Sleeps, then echoes the key.

        Args:
            key: Anything.
        """
        await asyncio.sleep(tool_sleep_s)
        return f"value of {key}"

    reply = "Calling tools.\n" + "\n".join(tool_call_text("slow_tool", {"key": f"k{i}"}) for i in range(calls))
    backend = FakeScriptedBackend(tokenizer, lambda prompt: reply, latency_s=generation_s)
    agent = ToolCallingAgent(
        backend,
        tokenizer,
        tools=[slow_tool],
        chat_template="qwen2.5",
        max_turns=turns,
        max_context_tokens=32768,
        parallel_tool_calls=parallel_tool_calls,
    )
    num_chains = min(CHAINS_PER_TASK, chains)
    tasks = [{"question": f"Task {i}: look everything up."} for i in range(-(-chains // num_chains))]
    gc.collect()
    collections = {"s": 0.0, "full": 0, "started": 0.0}

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections["started"] = time.perf_counter()
        else:
            collections["s"] += time.perf_counter() - collections["started"]
            collections["full"] += info["generation"] == 2

    gc.callbacks.append(on_collection)
    try:
        started, cpu_started = time.perf_counter(), time.process_time()
        trajectories = asyncio.run(agent.run(tasks, num_chains=num_chains, progress=False))
        wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    finally:
        gc.callbacks.remove(on_collection)
    trajectories = trajectories[:chains]
    if not all(t.num_turns == turns and t.tool_calls == turns * calls for t in trajectories):
        raise RuntimeError("the benchmark workload did not run as specified")
    critical_path_s = turns * (generation_s + tool_sleep_s)
    return {
        "mode": "concurrent tools" if parallel_tool_calls else "sequential tools",
        "chains": len(tasks) * num_chains,
        "turns": turns,
        "calls_per_turn": calls,
        "tool_sleep_s": tool_sleep_s,
        "generation_s": generation_s,
        "wall_s": round(wall_s, 4),
        "critical_path_s": round(critical_path_s, 4),
        "ratio": round(wall_s / critical_path_s, 4),
        "cpu_s": round(cpu_s, 4),
        "gc_s": round(collections["s"], 4),
        "full_collections": collections["full"],
        "frozen_objects": gc.get_freeze_count(),  # left out of every collection (the start-up heap, when frozen)
        "tool_calls": int(agent.last_run_stats["tool_calls"]),
    }


def main(argv: list[str] | None = None, *, tokenizer: Any = None) -> dict[str, dict[str, Any]]:
    """Parse arguments, run both modes, print JSON lines and a summary; returns the two results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chains", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3, help="tool calls per turn")
    parser.add_argument("--tool-sleep", type=float, default=0.2, help="seconds each tool call takes")
    parser.add_argument("--generation", type=float, default=0.1, help="seconds sampling one turn takes")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode; the fastest is reported")
    parser.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_false",
        help="do not freeze the objects that exist before the runs (imports, tokenizer) as the trainer does: "
        "full collections during a run then walk all of them (see the module docstring)",
    )
    args = parser.parse_args(argv)
    if tokenizer is None:
        from agentfly_jax.rollout.tokenizers import build_qwen2_5_tokenizer

        tokenizer = build_qwen2_5_tokenizer()
    frozen_here = freeze_startup_heap() if args.gc_freeze else False  # as the trainer's setup does
    results = {}
    try:
        for parallel in (True, False):
            runs = [
                run_overlap_benchmark(
                    tokenizer,
                    chains=args.chains,
                    turns=args.turns,
                    calls=args.calls,
                    tool_sleep_s=args.tool_sleep,
                    generation_s=args.generation,
                    parallel_tool_calls=parallel,
                )
                for _ in range(args.repeats)
            ]
            best = min(runs, key=lambda result: result["wall_s"])
            results["concurrent" if parallel else "sequential"] = best
            print(json.dumps(best))
    finally:
        unfreeze_startup_heap(frozen_here)  # a caller in the same process (the test) gets its collector back
    concurrent, sequential = results["concurrent"], results["sequential"]
    frozen = ", start-up heap frozen as the trainer does" if args.gc_freeze else ", start-up heap not frozen"
    print(
        f"\n{concurrent['chains']} chains x {args.turns} turns x {args.calls} calls "
        f"(tool {args.tool_sleep:g} s, generation {args.generation:g} s) on {platform.machine()} "
        f"({os.cpu_count()} CPUs){frozen}\n"
        f"critical path {concurrent['critical_path_s']:.3f} s | concurrent tools: {concurrent['wall_s']:.3f} s, "
        f"ratio {concurrent['ratio']:.3f} (target <= 1.10 at 256 chains; {concurrent['gc_s']:.3f} s in "
        f"garbage collection, {concurrent['full_collections']} full) | sequential tools: "
        f"{sequential['wall_s']:.3f} s, ratio {sequential['ratio']:.3f} | "
        f"speed-up {sequential['wall_s'] / concurrent['wall_s']:.2f}x"
    )
    return results


if __name__ == "__main__":
    main()

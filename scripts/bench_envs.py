"""Benchmarks of the resource manager and the code sandboxes.

    .venv/bin/python scripts/bench_envs.py            # full: 1,000 chains, sandbox runs on both backends
    .venv/bin/python scripts/bench_envs.py --quick    # short version (tests/envs/test_bench_envs.py runs it)
    .venv/bin/python scripts/bench_envs.py --backends bwrap --json out.json

Resource manager (a light in-memory environment, so the manager's own cost is what is measured):
  - 1,000 concurrent chains, each acquiring its environment by key, taking 3 steps and releasing, for a few
    rounds: acquire latency (p50 / p99 / max, from the manager's metrics), release cost, acquire+release
    cycles per second (background reset + health check included); once with a pool twice the number of
    chains, once with a pool of 1/10 of it (chains queue for instances);
  - peer in the same run: no pooling (a new environment created and closed for every chain).
Sandboxes (each backend):
  - one-shot `run_python("print(i)")` executions per second at a given concurrency, with p50 latency;
  - cells per second in one warm persistent session;
  - peers in the same run: an unsandboxed `python3 -c` subprocess (not a sandbox: the floor) and, for Docker,
    a fresh container per run (what a pool avoids).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import time

from agentfly_jax.envs import Environment, ResourceManager, StepResult
from agentfly_jax.envs.sandbox import close_sandboxes, get_sandbox, run_python


class EchoEnv(Environment):
    """A light environment: no I/O, so only the manager's overhead shows."""

    def __init__(self):
        self.steps = 0

    async def reset(self, task=None):
        self.steps = 0
        return "ready"

    async def step(self, action):
        self.steps += 1
        return StepResult(observation=action)


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


async def bench_manager(chains: int, rounds: int, pool_size: int) -> dict:
    manager = ResourceManager(
        {"echo": {"factory": EchoEnv, "max_size": pool_size, "min_size": pool_size, "acquire_timeout": 600}}
    )
    await manager.start()
    release_s = []

    async def chain(i):
        for r in range(rounds):
            lease = manager.acquire("echo", f"chain-{i}-{r}")
            env = await lease.__aenter__()
            for t in range(3):
                await env.step(t)
            t0 = time.perf_counter()
            await lease.__aexit__(None, None, None)
            release_s.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(chain(i) for i in range(chains)))
    # Recycling (reset + health check) runs in the background: count it in the wall time.
    while manager.metrics("echo")["recycling"]:
        await asyncio.sleep(0.001)
    wall = time.perf_counter() - start
    metrics = manager.metrics("echo")
    await manager.close()
    lat = metrics["acquire_latency_s"]
    return {
        "chains": chains,
        "rounds": rounds,
        "pool_size": pool_size,
        "wall_s": wall,
        "cycles_per_s": chains * rounds / wall,
        "acquire_p50_ms": lat["p50"] * 1e3,
        "acquire_p99_ms": lat["p99"] * 1e3,
        "acquire_max_ms": lat["max"] * 1e3,
        "release_p50_us": percentile(release_s, 0.5) * 1e6,
        "release_p99_us": percentile(release_s, 0.99) * 1e6,
        "created": metrics["created"],
        "destroyed": metrics["destroyed"],
    }


async def bench_no_pool(chains: int, rounds: int) -> dict:
    """Peer: a fresh environment for every chain (created, reset, used, closed)."""

    async def chain(i):
        for _ in range(rounds):
            env = EchoEnv()
            await env.reset()
            for t in range(3):
                await env.step(t)
            await env.close()

    start = time.perf_counter()
    await asyncio.gather(*(chain(i) for i in range(chains)))
    wall = time.perf_counter() - start
    return {"chains": chains, "rounds": rounds, "wall_s": wall, "cycles_per_s": chains * rounds / wall}


async def bench_runs(backend: str, runs: int, concurrency: int) -> dict:
    await run_python("pass", backend=backend)  # warm-up (Docker: the warm containers)
    semaphore = asyncio.Semaphore(concurrency)
    latencies = []

    async def one(i):
        async with semaphore:
            t0 = time.perf_counter()
            result = await run_python(f"print({i})", backend=backend, timeout=30)
            latencies.append(time.perf_counter() - t0)
            assert result.stdout == f"{i}\n", result

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(runs)))
    wall = time.perf_counter() - start
    return {
        "backend": backend,
        "runs": runs,
        "concurrency": concurrency,
        "execs_per_s": runs / wall,
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
    }


async def bench_session(backend: str, cells: int) -> dict:
    session = await get_sandbox(backend).open_session()
    try:
        await session.run_cell("x = 0")
        start = time.perf_counter()
        for _ in range(cells):
            result = await session.run_cell("x += 1\nx")
        wall = time.perf_counter() - start
        assert result.value == str(cells), result
    finally:
        await session.close()
    return {"backend": backend, "cells": cells, "cells_per_s": cells / wall, "mean_ms": wall / cells * 1e3}


async def bench_plain_subprocess(runs: int, concurrency: int) -> dict:
    """Peer (NOT a sandbox): `python3 -c` as a plain subprocess, the cost floor of starting Python."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(i):
        async with semaphore:
            proc = await asyncio.create_subprocess_exec(
                "/usr/bin/python3", "-I", "-c", f"print({i})", stdout=asyncio.subprocess.PIPE
            )
            await proc.communicate()

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(runs)))
    return {"runs": runs, "concurrency": concurrency, "execs_per_s": runs / (time.perf_counter() - start)}


def bench_fresh_containers(runs: int, concurrency: int) -> dict:
    """Peer: a new locked-down container per run (create, start, wait, remove), no pool."""
    import concurrent.futures

    import docker

    from agentfly_jax.envs.sandbox.docker_backend import DEFAULT_IMAGE

    client = docker.from_env(max_pool_size=concurrency + 4)

    def one(i):
        out = client.containers.run(
            DEFAULT_IMAGE,
            ["python3", "-I", "-c", f"print({i})"],
            remove=True,
            network_mode="none",
            read_only=True,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mem_limit="1g",
            pids_limit=64,
        )
        assert out == f"{i}\n".encode(), out

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(runs)))
    wall = time.perf_counter() - start
    client.close()
    return {"runs": runs, "concurrency": concurrency, "execs_per_s": runs / wall}


async def main(args) -> dict:
    results = {
        "command": " ".join(["scripts/bench_envs.py", *sys.argv[1:]]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    chains, rounds = (100, 3) if args.quick else (1000, 5)
    # Room to spare (instances are recycled in the background while others are handed out), then a pool
    # ten times smaller than the number of chains (chains queue for instances).
    results["manager"] = [
        await bench_manager(chains, rounds, pool_size=2 * chains),
        await bench_manager(chains, rounds, pool_size=max(1, chains // 10)),
    ]
    results["manager_peer_no_pool"] = await bench_no_pool(chains, rounds)
    runs, cells = (8, 20) if args.quick else (200, 500)
    results["sandbox"] = []
    for backend in args.backends:
        results["sandbox"].append(
            {
                "runs": await bench_runs(backend, runs, args.concurrency),
                "session": await bench_session(backend, cells),
            }
        )
    results["peer_plain_subprocess"] = await bench_plain_subprocess(runs, args.concurrency)
    if "docker" in args.backends and not args.quick:
        results["peer_docker_fresh_container"] = bench_fresh_containers(32, args.concurrency)
    await close_sandboxes()
    return results


def machine() -> str:
    try:
        model = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor()
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return f"CPU ({cores} cores): {model}"


def report(results: dict) -> str:
    lines = [f"{results['command']} — {results['machine']} — {results['date']}"]
    for m in results["manager"]:
        lines.append(
            f"manager  {m['chains']} chains x {m['rounds']} rounds, pool {m['pool_size']}: "
            f"{m['cycles_per_s']:,.0f} acquire/release cycles/s; acquire p50 {m['acquire_p50_ms']:.3f} ms, "
            f"p99 {m['acquire_p99_ms']:.2f} ms, max {m['acquire_max_ms']:.1f} ms; release p50 "
            f"{m['release_p50_us']:.1f} us"
        )
    peer = results["manager_peer_no_pool"]
    lines.append(f"peer     no pool (new env per chain): {peer['cycles_per_s']:,.0f} cycles/s")
    for s in results["sandbox"]:
        r, c = s["runs"], s["session"]
        lines.append(
            f"{r['backend']:<8} run_python: {r['execs_per_s']:.1f} execs/s at concurrency {r['concurrency']} "
            f"(p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms); session: {c['cells_per_s']:.0f} "
            f"cells/s ({c['mean_ms']:.1f} ms per cell)"
        )
    plain = results["peer_plain_subprocess"]
    lines.append(f"peer     plain python3 subprocess (not a sandbox): {plain['execs_per_s']:.1f} execs/s")
    if "peer_docker_fresh_container" in results:
        fresh = results["peer_docker_fresh_container"]
        lines.append(
            f"peer     docker fresh container per run: {fresh['execs_per_s']:.2f} execs/s "
            f"({fresh['runs']} runs at concurrency {fresh['concurrency']})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a short version (100 chains, few runs)")
    parser.add_argument("--backends", nargs="+", default=["bwrap", "docker"], choices=["bwrap", "docker"])
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent sandbox runs")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    out = asyncio.run(main(args))
    print(report(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)

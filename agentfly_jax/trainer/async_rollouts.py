"""Asynchronous off-policy training: rollouts that run ahead of the trainer by at most `rl.max_staleness` versions.

With `rl.max_staleness = 0` the loop is synchronous (rollout → update → weight sync) and none of this is used.
With `rl.max_staleness = k >= 1`:

- The async world (agents, backend, tools, environments) runs on one asyncio event loop in a background thread
  (`ThreadedRunner`), so chains keep advancing while the trainer's jitted update runs on the main thread.
  `runner.run(coro)` keeps its meaning from any thread other than the loop's.
- `RolloutProducer` starts the rollout batch of step s (the same `loop.rollout(run, s)` as the synchronous loop:
  its tasks, seeds and dynamic sampling) as soon as the policy version is >= s - k, in its own worker thread; up
  to k + 1 batches generate at once. The update of step s (policy version s) takes batch s, which started at
  version >= s - k, so no token of it is more than k versions old: that is the staleness bound, and the trainer
  checks it on each trajectory (`policy_version`, the version of its OLDEST sampled token) — a trajectory over
  the bound would be dropped and counted (`async/stale_dropped`).
- At each weight sync, sequences in flight either finish on the old weights first (default: the backend pauses
  admission and drains them) or, with `rl.partial_rollouts`, are interrupted: they continue on the new weights at
  once, and each token records the version that sampled it (`Trajectory.token_versions`).

The off-policy correction is decoupled PPO: the clipped ratio is taken against the proximal policy (the
parameters at the start of the update, whose log-probabilities `prepare` recomputes as `old_logprobs`, or the train
step's own forward pass gives with one optimiser step per update: `rl.old_logprobs`), and each
token's policy-gradient term is weighted by the truncated behaviour ratio min(π_prox / π_behaviour, `loss.is_cap`),
with π_behaviour the log-probabilities the sampler recorded when it drew the token (`sampler_logprobs`). Those are
exactly the probabilities of the distribution that sampled each token, also for a sequence whose weights changed
mid-way, so the correction needs no guess about which weights were used. `loss.is_cap` is required with
`max_staleness > 0` (the config refuses a run without it).

Faults: a rollout batch that fails (a crashed worker, a lost server) is raised to the trainer by `take`; the loop
saves the trainer state of the last finished update before stopping (`loop.train`), so nothing trained is lost and
`config.resume` continues from there.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class ThreadedRunner:
    """An asyncio event loop running in its own thread, with `asyncio.Runner`'s `run(coro)` / `get_loop()`.

    `run` may be called from any thread but the loop's own, by several threads at once; it waits for the
    coroutine's result (or exception). After `close()`, waiting callers get a RuntimeError instead of blocking.
    """

    def __init__(self, name: str = "agentfly-async"):
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def run(self, coro):
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("ThreadedRunner.run was called from its own event-loop thread (it would wait on "
                               "itself); await the coroutine there instead")
        if self._closed:
            coro.close()
            raise RuntimeError("the rollout event loop is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        while True:
            try:
                return future.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if self._closed:
                    future.cancel()
                    raise RuntimeError("the rollout event loop was closed while a call on it was running") from None

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancels the loop's pending tasks, gives them `timeout_s` to end, stops the loop and joins its thread."""
        if self._closed:
            return
        loop = self._loop

        async def _cancel_pending():
            current = asyncio.current_task()
            pending = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
            for task in pending:
                task.cancel()
            if pending:
                _, stuck = await asyncio.wait(pending, timeout=timeout_s)
                if stuck:
                    log.warning("%d background task(s) ignored cancellation for %.0f s (abandoned tool calls or "
                                "rewards); closing the event loop without them", len(stuck), timeout_s)
            await loop.shutdown_asyncgens()

        try:
            asyncio.run_coroutine_threadsafe(_cancel_pending(), loop).result(timeout=timeout_s + 10)
        except Exception as exc:  # noqa: BLE001 - closing goes on whatever the tasks did
            log.warning("closing the rollout event loop: %s: %s", type(exc).__name__, exc)
        self._closed = True
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            log.warning("the rollout event-loop thread did not stop within %.0f s", timeout_s)
            return
        loop.close()


@dataclasses.dataclass
class Batch:
    """One step's rollout result, as the producer hands it to the trainer."""

    step: int
    result: Any  # what `produce(step)` returned
    started: float  # perf_counter when its rollout started / ended
    ended: float
    version_at_start: int  # the policy version served when the rollout started


class RolloutProducer:
    """Runs `produce(step)` for steps [start, end) in worker threads, each one as soon as the trainer's policy
    version allows (`step <= version + max_staleness`), and hands the results over in step order.

    The trainer calls `take(step)` (blocks until batch `step` is done; the wait is counted as the trainer's idle
    time) and `advance(version)` after each weight sync. `idle_s(since)` is the time since `since` in which no
    batch was generating (the rollout side waiting on the staleness bound)."""

    def __init__(self, produce: Callable[[int], Any], start: int, end: int, max_staleness: int,
                 version: Callable[[], int]):
        if max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness}: the producer is for asynchronous runs (>= 1)")
        self._produce, self._end, self._k = produce, end, max_staleness
        self._version = version
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_staleness + 1,
                                                           thread_name_prefix="agentfly-rollout")
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._intervals: list[list[float]] = []  # [start, end or None] of every batch, in start order
        self._lock = threading.Lock()
        self._next = start
        self._closed = False
        self.advance(version())

    def advance(self, version: int) -> None:
        """Starts every batch the bound now allows: steps up to `version + max_staleness`."""
        while not self._closed and self._next < self._end and self._next <= version + self._k:
            step = self._next
            self._futures[step] = self._pool.submit(self._run_one, step)
            self._next += 1

    def _run_one(self, step: int) -> Batch:
        version = int(self._version())
        started = time.perf_counter()
        with self._lock:
            interval = [started, None]
            self._intervals.append(interval)
        try:
            result = self._produce(step)
        finally:
            ended = time.perf_counter()
            with self._lock:
                interval[1] = ended
        return Batch(step=step, result=result, started=started, ended=ended, version_at_start=version)

    def take(self, step: int) -> tuple[Batch, float]:
        """(batch `step`, seconds the caller waited for it). A batch that raised re-raises here."""
        future = self._futures.pop(step, None)
        if future is None:
            raise RuntimeError(f"rollout batch {step} was never started (next to start: {self._next}); the trainer "
                               "must take steps in order and advance the version after each update")
        t0 = time.perf_counter()
        batch = future.result()
        return batch, time.perf_counter() - t0

    def idle_s(self, since: float, until: float | None = None) -> float:
        """Seconds of [since, until] in which no batch was generating."""
        until = time.perf_counter() if until is None else until
        with self._lock:
            spans = sorted((max(a, since), min(b if b is not None else until, until))
                           for a, b in self._intervals if (b is None or b > since) and a < until)
        busy, cursor = 0.0, since
        for a, b in spans:
            a = max(a, cursor)
            if b > a:
                busy += b - a
                cursor = b
        with self._lock:  # forget intervals that ended before `since`: they can no longer matter
            self._intervals = [iv for iv in self._intervals if iv[1] is None or iv[1] > since]
        return max(0.0, (until - since) - busy)

    @property
    def in_flight(self) -> int:
        return sum(not f.done() for f in self._futures.values())

    def close(self) -> None:
        """Starts nothing more; batches not yet running are cancelled. Running batches end when their event loop
        is closed (their `runner.run` raises), so the caller closes the runner after this."""
        self._closed = True
        for future in self._futures.values():
            future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)


def staleness_filter(trajectories, version: int, max_staleness: int):
    """(trajectories within the bound, dropped ones, staleness of each kept one): staleness = `version` (the
    policy being updated) - the version of the trajectory's oldest sampled token."""
    kept, dropped, staleness = [], [], []
    for t in trajectories:
        lag = int(version) - int(t.policy_version)
        if lag > max_staleness:
            dropped.append(t)
        else:
            kept.append(t)
            staleness.append(lag)
    return kept, dropped, staleness


__all__ = ["Batch", "RolloutProducer", "ThreadedRunner", "staleness_filter"]

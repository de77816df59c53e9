"""Asynchronous off-policy training (rl.max_staleness, rl.partial_rollouts): the staleness-bounded rollout
producer, the threaded event loop, the trainer loop's asynchronous path on a long-tail workload (the short version
of scripts/bench_async.py, with the tests' scripted FAKE backend and the real update step), and faults: a rollout
whose backend is lost, a weight sync that fails and an update that fails midway stop the run with the last
finished trainer state saved, without hanging."""
from __future__ import annotations

import asyncio
import faulthandler
import gc
import json
import os
import threading
import time
import types

import pytest

from agentfly_jax.trainer import loop
from agentfly_jax.trainer.async_rollouts import RolloutProducer, ThreadedRunner, staleness_filter
from agentfly_jax.trainer.checkpoint import Checkpointer
from agentfly_jax.trainer.config import ConfigError, TrainConfig
from experiments import quickstart
from tests.rollout.fakes import FakeScriptedBackend
from tests.script_modules import load_script

bench_async = load_script("bench_async")


@pytest.fixture(autouse=True)
def no_hang():
    """A test of this file that hangs (a deadlock is what these tests guard against) fails the run loudly."""
    faulthandler.dump_traceback_later(240, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# ------------------------------------------------------------------------------------------------ producer
def test_producer_starts_each_batch_only_within_the_staleness_bound():
    version, started, lock = [0], {}, threading.Lock()

    def produce(step):
        with lock:
            started[step] = version[0]
        time.sleep(0.02)
        return f"batch {step}"

    producer = RolloutProducer(produce, 0, 8, 2, version=lambda: version[0])
    time.sleep(0.2)
    assert sorted(started) == [0, 1, 2]  # version 0: steps 0..2, not 3
    for step in range(8):
        batch, waited = producer.take(step)
        assert batch.result == f"batch {step}" and waited >= 0 and batch.ended >= batch.started
        assert step - batch.version_at_start <= 2
        time.sleep(0.05)
        assert max(started) <= step + 2  # nothing beyond the bound before the version moves on
        version[0] = step + 1
        producer.advance(step + 1)
    assert sorted(started) == list(range(8)) and all(step - v <= 2 for step, v in started.items())
    producer.close()


def test_producer_hands_a_failed_batch_to_the_trainer_and_refuses_steps_out_of_order():
    def produce(step):
        if step == 1:
            raise ValueError("the rollout worker crashed")
        return step

    producer = RolloutProducer(produce, 0, 4, 1, version=lambda: 0)
    assert producer.take(0)[0].result == 0
    with pytest.raises(ValueError, match="crashed"):
        producer.take(1)
    with pytest.raises(RuntimeError, match="never started"):
        producer.take(3)
    producer.close()
    with pytest.raises(ValueError, match="max_staleness=0"):
        RolloutProducer(produce, 0, 4, 0, version=lambda: 0)


def test_idle_time_is_the_time_no_batch_was_generating():
    producer = RolloutProducer(lambda step: time.sleep(0.3), 0, 1, 1, version=lambda: 0)
    t0 = time.perf_counter()
    producer.take(0)
    time.sleep(0.3)
    idle = producer.idle_s(t0)
    assert 0.25 <= idle <= 0.45  # the batch ran ~0.3 s of the ~0.6 s
    producer.close()


def test_staleness_filter_measures_from_the_oldest_token():
    trajectories = [types.SimpleNamespace(policy_version=v) for v in (5, 4, 3, 2)]
    kept, dropped, lags = staleness_filter(trajectories, 5, 2)
    assert [t.policy_version for t in kept] == [5, 4, 3] and lags == [0, 1, 2]
    assert [t.policy_version for t in dropped] == [2]


# ------------------------------------------------------------------------------------------ threaded loop
def test_threaded_runner_serves_several_threads_and_refuses_its_own():
    runner = ThreadedRunner()
    results = []

    async def work(i):
        await asyncio.sleep(0.05)
        return i, threading.current_thread().name

    threads = [threading.Thread(target=lambda i=i: results.append(runner.run(work(i)))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i for i, _ in results) == [0, 1, 2, 3]
    assert {name for _, name in results} == {"agentfly-async"}  # every coroutine ran on the loop's thread

    async def nested():
        return runner.run(work(9))

    with pytest.raises(RuntimeError, match="own event-loop thread"):
        runner.run(nested())
    runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner.run(work(0))


def test_closing_the_runner_releases_a_thread_waiting_on_it():
    runner = ThreadedRunner()
    outcome = []

    def waiter():
        try:
            runner.run(asyncio.sleep(3600))
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(type(exc).__name__)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    runner.close(timeout_s=2)
    thread.join(timeout=10)
    assert not thread.is_alive() and outcome and time.perf_counter() - t0 < 10


# -------------------------------------------------------------------------------------------------- config
def test_config_refuses_async_without_the_off_policy_correction_and_partial_without_async():
    c = quickstart.get_config("cpu")
    c.rl.max_staleness = 2
    with pytest.raises(ConfigError, match="is_cap"):
        TrainConfig.build(c)
    c.loss.is_cap = 2.0
    assert TrainConfig.build(c).rl.max_staleness == 2
    c.rl.max_staleness, c.rl.partial_rollouts = 0, True
    with pytest.raises(ConfigError, match="partial_rollouts"):
        TrainConfig.build(c)


# ------------------------------------------------------------------------------------------ the loop, async
BENCH = ["--steps", "5", "--tasks", "4", "--chains", "2", "--generation", "0.1", "--long-turns", "5",
         "--tail-every", "2"]


def test_bench_async_short_version_trains_faster_within_the_staleness_bound():
    out = bench_async.main(BENCH)
    sync, async_ = out["results"]
    for result in (sync, async_):
        assert result["trajectories"] == 3 * 4 * 2  # the 3 timed steps (after the first 2), every chain
        assert result["turns_per_chain_mean"] > 2  # the long tail is there
    assert async_["max_staleness"] == 2 and 1 <= async_["staleness_max"] <= 2
    # the long-tail rollouts of later steps overlap: measured ~2x here; a loop that serialised them would be ~1x
    assert out["speedup"]["async_staleness_2"] > 1.2


def _args(**overrides):
    values = {"steps": 4, "tasks": 4, "chains": 2, "generation": 0.02, "long_turns": 2, "tail_every": 2,
              "partial": False}
    values.update(overrides)
    return types.SimpleNamespace(**values)


def test_partial_rollouts_interrupt_at_each_weight_sync(tmp_path):
    backends = []

    def make_backend(tokenizer):
        backends.append(FakeScriptedBackend(tokenizer, bench_async.long_tail_script(2, 2), latency_s=0.02,
                                            report_weight_version=True))
        return backends[-1]

    with bench_async.scripted_training(make_backend):
        summary = loop.train(bench_async.config(_args(partial=True), 1, str(tmp_path)))
    assert summary["steps"] == 4
    assert backends[0].weight_updates == [(1, True), (2, True), (3, True), (4, True)]
    with open(tmp_path / "tensorboard" / "metrics.jsonl") as fh:
        rows = [json.loads(line) for line in fh if "async/staleness_max" in line]
    assert len(rows) == 4 and all(r["async/staleness_max"] <= 1 for r in rows)
    assert {"async/trainer_wait_s", "async/rollout_idle_s", "async/interrupted_sequences",
            "async/weight_sync_wait_s", "async/staleness_mean"} <= set(rows[0])


class LostServerBackend(FakeScriptedBackend):
    """FAKE backend: answers `healthy_calls` generate calls, then every call fails like a lost server."""

    def __init__(self, *args, healthy_calls: int, fail_sync_at: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.healthy_calls, self.fail_sync_at = healthy_calls, fail_sync_at

    async def generate(self, *args, **kwargs):
        if len(self.calls) >= self.healthy_calls:
            self.calls.append({})
            raise ConnectionError("the generation server was lost")
        return await super().generate(*args, **kwargs)

    async def update_weights(self, params, version, *, interrupt=False):
        if version == self.fail_sync_at:
            raise ConnectionError("the generation server died during the weight update")
        await super().update_weights(params, version, interrupt=interrupt)


@pytest.mark.parametrize("fault", ["rollout", "weight_sync", "update"])
def test_a_failure_stops_the_run_with_the_last_finished_state_saved(tmp_path, fault, monkeypatch):
    def make_backend(tokenizer):
        script = bench_async.long_tail_script(2, 2)
        if fault == "rollout":  # the first two steps' chains (3 turns at most each) get through, then none
            return LostServerBackend(tokenizer, script, latency_s=0.02, report_weight_version=True,
                                     healthy_calls=2 * 4 * 2 * 3)
        return LostServerBackend(tokenizer, script, latency_s=0.02, report_weight_version=True,
                                 healthy_calls=10**9, fail_sync_at=2)

    if fault == "update":  # the second update fails after its first mini-batch changed the state
        real_update, calls = loop.update, []

        def failing_update(run, batch, step):
            calls.append(step)
            if step == 1:
                real_update(run, batch, step)  # the state moves on (run.state) ...
                raise RuntimeError("the update failed between its mini-batches")  # ... and the step never ends
            return real_update(run, batch, step)

        monkeypatch.setattr(loop, "update", failing_update)
    cfg = bench_async.config(_args(steps=6), 1, str(tmp_path))
    t0 = time.perf_counter()
    with bench_async.scripted_training(make_backend), pytest.raises((RuntimeError, ConnectionError)) as caught:
        loop.train(cfg)
    assert time.perf_counter() - t0 < 120
    assert any(word in str(caught.value) for word in ("lost", "died", "chain", "mini-batches"))
    checkpoints = Checkpointer(os.path.join(str(tmp_path), "checkpoints"), every=0)
    try:
        steps = checkpoints.manager.all_steps()
    finally:
        checkpoints.close()
    with open(tmp_path / "tensorboard" / "metrics.jsonl") as fh:
        logged = sum("reward/mean" in line for line in fh)  # steps that finished (update, sync, scalars)
    # the trainer state of the last finished update is on disk: step 2 when the sync to version 2 failed (its update
    # was done), the steps that finished when the rollouts failed; a failure inside an update saves nothing (that
    # state is neither step): the last checkpoint is the one before it
    if fault == "weight_sync":
        assert max(steps) == 2 and logged == 1
    elif fault == "rollout":
        assert logged >= 1 and max(steps) == logged
    else:
        assert logged == 1 and max(steps) == 0


def test_separate_sampler_device_keeps_generation_off_the_training_mesh(tmp_path):
    import jax

    c = quickstart.get_config("cpu")
    c.workdir = str(tmp_path)
    c.jax_sampler.separate_device = True
    c.rl.max_staleness, c.loss.is_cap = 1, 2.0
    run = loop.setup(c)
    try:
        # the start-up heap is frozen once everything is built (agentfly_jax/heap.py), and given back at close
        assert run.heap_frozen and gc.get_freeze_count() > 10_000
        devices = jax.devices()
        assert run.backend.device == devices[-1]
        assert sorted(d.id for d in run.mesh.devices.flat) == sorted(d.id for d in devices[:-1])
        assert {d.id for leaf in jax.tree.leaves(run.state.policy.params) for d in leaf.devices()} <= {
            d.id for d in devices[:-1]}
        loop.sync_weights(run, 1)  # the trained params (on the mesh) reach the sampler's own device
        assert {d.id for leaf in jax.tree.leaves(run.backend._params) for d in leaf.devices()} == {devices[-1].id}
        [completion] = run.runner.run(run.backend.generate([1, 2, 3], max_tokens=4, temperature=1.0, seed=0))
        assert len(completion.token_ids) >= 1 and completion.token_versions[0] == 1
    finally:
        loop._close_run(run)
    assert not run.heap_frozen and gc.get_freeze_count() == 0
    c.backend, c.vllm.launch = "vllm", True
    with pytest.raises(ConfigError, match="separate_device"):
        TrainConfig.build(c)

"""LocalVLLMServers' failure paths and the trainer's `vllm.launch` checks (no server is started here; the real
launch is exercised by tests/trainer/test_train_loop.py::test_quickstart_on_the_vllm_server_improves_reward)."""
import asyncio
import subprocess
import threading
import time

import pytest

from agentfly_jax.rollout.backends import LocalVLLMServers, VLLMLaunchError
from agentfly_jax.trainer import builders
from agentfly_jax.trainer.config import ConfigError, TrainConfig
from experiments.quickstart import get_config


def test_a_failed_start_raises_with_the_scripts_output(tmp_path):
    servers = LocalVLLMServers(str(tmp_path / "no_such_model"), run_dir=str(tmp_path / "run"))
    with pytest.raises(VLLMLaunchError, match="start_vllm.sh .*no_such_model.* failed"):
        servers.start()
    assert servers.urls == []  # nothing left registered to stop
    servers.stop()  # idempotent


def test_num_servers_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="num_servers=0"):
        LocalVLLMServers(str(tmp_path), num_servers=0)


def test_launch_and_urls_together_are_refused():
    config = get_config()
    config.backend = "vllm"
    config.vllm.launch = True
    config.vllm.urls = ("http://127.0.0.1:8000",)
    with pytest.raises(ConfigError, match="leave config.vllm.urls empty"):  # at start, before any server
        TrainConfig.build(config)


def test_vllm_without_urls_or_launch_says_what_to_set():
    config = get_config()
    config.backend = "vllm"
    with pytest.raises(ConfigError, match="config.vllm.urls .* or config.vllm.launch=True"):
        TrainConfig.build(config)


def test_an_interrupted_start_stops_the_server_being_started(tmp_path, monkeypatch):
    """A KeyboardInterrupt while start_vllm.sh runs: the port was registered first, so stop() reaches it."""
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd[1].rsplit("/", 1)[-1])
        if cmd[1].endswith("start_vllm.sh"):
            raise KeyboardInterrupt
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr("agentfly_jax.rollout.backends.vllm_launcher.subprocess.run", fake_run)
    servers = LocalVLLMServers(str(tmp_path), run_dir=str(tmp_path / "run"))
    with pytest.raises(KeyboardInterrupt):
        servers.start()
    assert calls == ["start_vllm.sh", "stop_vllm.sh"] and servers.urls == []


def test_max_model_len_follows_the_agents_context_unless_given(tmp_path, monkeypatch):
    seen = {}

    class Recorder:
        def __init__(self, model_dir, num_servers, *, extra_args, run_dir):
            seen["args"] = list(extra_args)

        def start(self, *, wait=True):
            seen["wait"] = wait
            return ["http://127.0.0.1:1"]

    monkeypatch.setattr("agentfly_jax.rollout.backends.LocalVLLMServers", Recorder)
    monkeypatch.setattr(builders, "save_pretrained", lambda *a, **k: None)
    config = get_config()
    config.backend, config.vllm.launch, config.vllm.server_args = "vllm", True, ("--dtype", "float32")
    builders.build_backend(TrainConfig.build(config), model=None, params={}, workdir=str(tmp_path))
    length = config.agent.max_context_tokens + config.agent.max_new_tokens
    assert seen["args"] == ["--dtype", "float32", "--max-model-len", str(length)]
    assert seen["wait"] is False  # the servers start while the run warm-starts; the backend's first request waits
    config.vllm.server_args = ("--max-model-len", "512")
    builders.build_backend(TrainConfig.build(config), model=None, params={}, workdir=str(tmp_path))
    assert seen["args"] == ["--max-model-len", "512"]


def test_a_background_start_returns_at_once_and_its_failure_reaches_wait(tmp_path, caplog):
    servers = LocalVLLMServers(str(tmp_path / "no_such_model"), num_servers=2, run_dir=str(tmp_path / "run"))
    t0 = time.monotonic()
    urls = servers.start(wait=False)
    assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
    assert time.monotonic() - t0 < 1.0
    for _ in range(2):  # every time it is asked
        with pytest.raises(VLLMLaunchError, match="start_vllm.sh .*no_such_model.* failed"):
            servers.wait()
    assert servers.urls == [] and "starting the vLLM servers failed" in caplog.text
    servers.stop()


def test_stop_during_a_background_start_stops_the_server_being_started(tmp_path, monkeypatch):
    """stop() while start_vllm.sh waits for the first server: that server is stopped, the script ends (it sees
    its server gone), the second server is never started, and wait() says the start was stopped."""
    calls, started, stopped = [], threading.Event(), threading.Event()

    def fake_run(cmd, **kwargs):
        calls.append((cmd[1].rsplit("/", 1)[-1], cmd[-1] if "stop" in cmd[1] else cmd[3]))
        if cmd[1].endswith("start_vllm.sh"):
            started.set()
            assert stopped.wait(10)
            return subprocess.CompletedProcess(cmd, 1, "", "the server exited during start-up")
        stopped.set()
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr("agentfly_jax.rollout.backends.vllm_launcher.subprocess.run", fake_run)
    servers = LocalVLLMServers(str(tmp_path), num_servers=2, run_dir=str(tmp_path / "run"))
    first = int(servers.start(wait=False)[0].rsplit(":", 1)[1])
    assert started.wait(10)
    servers.stop()
    assert calls == [("start_vllm.sh", str(first)), ("stop_vllm.sh", str(first))]
    with pytest.raises(VLLMLaunchError, match="stopped while they were starting"):
        servers.wait()


class _Starting:
    """Owned servers still starting (a fake of LocalVLLMServers' background start): wait() blocks until released,
    then raises `error` if given."""

    def __init__(self, error=None):
        self.error, self.released, self.waits = error, threading.Event(), 0

    def wait(self):
        self.waits += 1
        assert self.released.wait(10)
        if self.error:
            raise self.error

    def stop(self):
        pass


def test_the_backends_first_request_waits_for_servers_starting_and_raises_their_error():
    from agentfly_jax.rollout.backends import VLLMBackend

    starting = _Starting(VLLMLaunchError("start_vllm.sh failed: out of memory"))
    backend = VLLMBackend(["http://127.0.0.1:9"], owned_servers=starting, max_retries=0)

    async def request():
        task = asyncio.create_task(backend.generate([1, 2, 3], max_tokens=4))
        await asyncio.sleep(0.3)
        assert not task.done()  # held until the servers are up
        starting.released.set()
        with pytest.raises(VLLMLaunchError, match="out of memory"):
            await task
        await backend.close()

    asyncio.run(request())
    assert starting.waits == 1

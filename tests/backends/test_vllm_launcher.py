"""LocalVLLMServers' failure paths and the trainer's `vllm.launch` checks (no server is started here; the real
launch is exercised by tests/trainer/test_train_loop.py::test_quickstart_on_the_vllm_server_improves_reward)."""
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
    import subprocess

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

        def start(self):
            return ["http://127.0.0.1:1"]

    monkeypatch.setattr("agentfly_jax.rollout.backends.LocalVLLMServers", Recorder)
    monkeypatch.setattr(builders, "save_pretrained", lambda *a, **k: None)
    config = get_config()
    config.backend, config.vllm.launch, config.vllm.server_args = "vllm", True, ("--dtype", "float32")
    builders.build_backend(TrainConfig.build(config), model=None, params={}, workdir=str(tmp_path))
    length = config.agent.max_context_tokens + config.agent.max_new_tokens
    assert seen["args"] == ["--dtype", "float32", "--max-model-len", str(length)]
    config.vllm.server_args = ("--max-model-len", "512")
    builders.build_backend(TrainConfig.build(config), model=None, params={}, workdir=str(tmp_path))
    assert seen["args"] == ["--max-model-len", "512"]

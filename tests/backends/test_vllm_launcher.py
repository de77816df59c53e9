"""LocalVLLMServers' failure paths and the trainer's `vllm.launch` checks (no server is started here; the real
launch is exercised by tests/trainer/test_train_loop.py::test_quickstart_on_the_vllm_server_improves_reward)."""
import pytest

from agentfly_jax.rollout.backends import LocalVLLMServers, VLLMLaunchError
from agentfly_jax.trainer import builders
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
    with pytest.raises(ValueError, match="leave config.vllm.urls empty"):
        builders.build_backend(config, model=None, params=None, workdir="unused")


def test_vllm_without_urls_or_launch_says_what_to_set():
    config = get_config()
    config.backend = "vllm"
    with pytest.raises(ValueError, match="config.vllm.urls .* or config.vllm.launch=True"):
        builders.build_backend(config, model=None, params=None)

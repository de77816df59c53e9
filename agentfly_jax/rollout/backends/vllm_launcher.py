"""Local vLLM servers started and stopped from Python (the trainer's `config.vllm.launch=True`).

The servers are started by the checkout's `scripts/start_vllm.sh` (which picks the vLLM install, the CPU flags and
the weight-sync worker extension) on free ports of 127.0.0.1 and stopped by `scripts/stop_vllm.sh` — the same
scripts a user runs by hand for servers on other machines (then pass their URLs as `config.vllm.urls`).

    servers = LocalVLLMServers(model_dir, num_servers=1, extra_args=("--dtype", "float32"), run_dir="runs/x/vllm")
    urls = servers.start()      # blocks until every server answers /health
    ...
    servers.stop()              # idempotent; also called by VLLMBackend.close() for servers it was given
"""
from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)

_SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


class VLLMLaunchError(RuntimeError):
    """A local vLLM server could not be started."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalVLLMServers:
    """`num_servers` vLLM servers on this machine serving `model_dir` (an HF checkpoint directory)."""

    def __init__(self, model_dir: str, num_servers: int = 1, *, extra_args: Sequence[str] = (),
                 run_dir: str | None = None, start_timeout: float = 600.0):
        if num_servers < 1:
            raise ValueError(f"num_servers={num_servers}; need at least 1")
        for script in ("start_vllm.sh", "stop_vllm.sh"):
            if not (_SCRIPTS / script).is_file():
                raise VLLMLaunchError(
                    f"launching vLLM servers needs scripts/{script} of an agentfly-jax checkout (looked in "
                    f"{_SCRIPTS}); start the servers yourself (scripts/start_vllm.sh) and pass config.vllm.urls")
        self.model_dir = os.path.abspath(model_dir)
        self.num_servers = int(num_servers)
        self.extra_args = [str(a) for a in extra_args]
        self.run_dir = os.path.abspath(run_dir) if run_dir else None
        self.start_timeout = float(start_timeout)
        self.ports: list[int] = []
        self._atexit_registered = False

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def _env(self) -> dict:
        env = {**os.environ, "VLLM_START_TIMEOUT": str(int(self.start_timeout))}
        if self.run_dir:
            env["AGENTFLY_VLLM_RUN_DIR"] = self.run_dir
        return env

    def start(self) -> list[str]:
        """Starts the servers one after the other (each takes about a minute on a CPU); returns their URLs.
        If one fails (or the start is interrupted), every server started so far — including the one being
        started — is stopped and VLLMLaunchError carries the script's output. Servers still running at
        interpreter exit are stopped too (atexit)."""
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        for _ in range(self.num_servers):
            port = _free_port()
            self.ports.append(port)  # registered before the script runs: an interrupt still stops it
            log.info("starting a vLLM server for %s on port %d", self.model_dir, port)
            try:
                proc = subprocess.run(["bash", str(_SCRIPTS / "start_vllm.sh"), self.model_dir, str(port),
                                       *self.extra_args], env=self._env(), capture_output=True, text=True)
            except BaseException:
                self.stop()
                raise
            if proc.returncode != 0:
                self.stop()
                raise VLLMLaunchError(f"scripts/start_vllm.sh {self.model_dir} {port} failed (exit "
                                      f"{proc.returncode}):\n{proc.stderr[-4000:]}")
        return self.urls

    def stop(self) -> None:
        """Stops every server this object started (SIGTERM, then SIGKILL to its process group)."""
        ports, self.ports = self.ports, []
        for port in ports:
            proc = subprocess.run(["bash", str(_SCRIPTS / "stop_vllm.sh"), str(port)], env=self._env(),
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                log.warning("stopping the vLLM server on port %d failed: %s", port, proc.stderr[-2000:])

    def __enter__(self) -> "LocalVLLMServers":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


__all__ = ["LocalVLLMServers", "VLLMLaunchError"]

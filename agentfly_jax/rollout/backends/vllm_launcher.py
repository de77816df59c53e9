"""Local vLLM servers started and stopped from Python (the trainer's `config.vllm.launch=True`).

The servers are started by the checkout's `scripts/start_vllm.sh` (which picks the vLLM install, the CPU flags and
the weight-sync worker extension) on free ports of 127.0.0.1 and stopped by `scripts/stop_vllm.sh` — the same
scripts a user runs by hand for servers on other machines (then pass their URLs as `config.vllm.urls`).

    servers = LocalVLLMServers(model_dir, num_servers=1, extra_args=("--dtype", "float32"), run_dir="runs/x/vllm")
    urls = servers.start()      # blocks until every server answers /health
    # or: urls = servers.start(wait=False), other work, then servers.wait() (the trainer: VLLMBackend waits)
    ...
    servers.stop()              # idempotent; also called by VLLMBackend.close() for servers it was given

A server dies with the process that launched it, however that process ends. `atexit` covers a normal exit, but
not `kill -9`, an OOM kill or a crash; and a parent-death signal cannot work here, because the server's parent is
start_vllm.sh, which exits once the server answers (the server runs in its own session, set up by `setsid`). So
start_vllm.sh starts a watchdog beside each server (this file run as a script: `watch`, standard library only, so
vLLM's own python runs it) that polls the launching process every second; once that process is gone (or a zombie,
or its pid was reused: its start time no longer matches) it sends SIGTERM to the server's whole process group
(API server and engine processes), then SIGKILL after $VLLM_STOP_TIMEOUT seconds (default 30). The watchdog
ends by itself once the server's group is gone (stop_vllm.sh, a crash); it logs to port-PORT.watchdog.log.
"""
from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

log = logging.getLogger(__name__)

_SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


class VLLMLaunchError(RuntimeError):
    """A local vLLM server could not be started."""


def process_start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, /proc/PID/stat field 22), or None when there is no such
    process or it is a zombie (dead, not yet reaped). Without /proc (not Linux): 0 for any live pid."""
    if not os.path.exists("/proc/self/stat"):  # no /proc: liveness only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on (after "pid (comm) "), or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a member that is not a zombie."""
    if not os.path.exists("/proc/self/stat"):  # no /proc: any member, zombie or not
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(name)
        if fields is not None and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):  # None: it just exited
            return True
    return False


def _say(message: str) -> None:
    print(f"[vllm watchdog {time.strftime('%Y-%m-%d %H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def watch(parent_pid: int, parent_start: int | None, group: int, *, poll: float = 1.0,
          grace: float = 30.0) -> str:
    """Waits until `group` (a server's process group) is gone, or until `parent_pid` is (then stops the group:
    SIGTERM, SIGKILL after `grace` seconds). `parent_start` (process_start_time of the parent when the server
    was launched; None to skip the check) tells a reused pid from the parent. Returns what happened."""
    _say(f"watching process group {group} for parent pid {parent_pid} (start time {parent_start})")
    # start_vllm.sh starts this watchdog right after forking the server, which may not have run setsid yet:
    # until it has, group `group` has no members and would look gone.
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        try:
            if os.getpgid(group) == group:
                break
        except ProcessLookupError:
            break
        time.sleep(0.05)
    while True:
        if not group_alive(group):
            _say(f"process group {group} is gone (stopped or crashed); nothing to do")
            return "group gone"
        start = process_start_time(parent_pid)
        if start is None or (parent_start is not None and start != parent_start):
            why = "exited" if start is None else f"was replaced (pid reused: start time {start} != {parent_start})"
            _say(f"parent pid {parent_pid} {why}: SIGTERM to process group {group}")
            break
        time.sleep(poll)
    _signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not group_alive(group):
            _say(f"process group {group} stopped after SIGTERM")
            return "stopped"
        time.sleep(min(poll, 0.2))
    _say(f"process group {group} still alive {grace:g} s after SIGTERM: SIGKILL")
    _signal_group(group, signal.SIGKILL)
    return "killed"


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _StoppedWhileStarting(VLLMLaunchError):
    """A background start ended by stop()."""


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
        self._starting: threading.Thread | None = None  # a background start (start(wait=False))
        self._stopping = False
        self._start_error: BaseException | None = None

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def _env(self) -> dict:
        # Who start_vllm.sh's watchdog watches: this process (pid and start time, so a reused pid is told apart).
        start = process_start_time(os.getpid())
        env = {**os.environ, "VLLM_START_TIMEOUT": str(int(self.start_timeout)),
               "AGENTFLY_VLLM_WATCH_PID": str(os.getpid()),
               "AGENTFLY_VLLM_WATCH_START": "" if start is None else str(start)}
        if self.run_dir:
            env["AGENTFLY_VLLM_RUN_DIR"] = self.run_dir
        return env

    def start(self, *, wait: bool = True) -> list[str]:
        """Starts the servers one after the other (each takes about a minute on a CPU); returns their URLs.
        If one fails (or the start is interrupted), every server started so far — including the one being
        started — is stopped and VLLMLaunchError carries the script's output. Servers still running at
        interpreter exit are stopped too (atexit), and each server's watchdog stops it when this process dies
        any other way (kill -9, crash).

        wait=False returns the URLs at once and starts the servers in a background thread, so that the caller
        can work meanwhile (the trainer's SFT stage); `wait()` blocks until they are up and raises what their
        start raised (a failure is also logged as it happens)."""
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        if self._starting is not None:
            raise RuntimeError("LocalVLLMServers.start() was called twice; stop() first")
        ports: list[int] = []
        while len(ports) < self.num_servers:
            port = _free_port()
            if port not in ports:
                ports.append(port)
        self._stopping, self._start_error = False, None
        if wait:
            self._start_ports(ports)
            return self.urls
        self._starting = threading.Thread(target=self._start_in_background, args=(ports,), daemon=True,
                                          name="vllm-server-start")
        self._starting.start()
        return [f"http://127.0.0.1:{p}" for p in ports]

    def wait(self) -> None:
        """Blocks until a background start (start(wait=False)) has ended; raises its error if it failed, every
        time it is asked. Returns at once after a start that waited."""
        if self._starting is not None:
            self._starting.join()
        if self._start_error is not None:
            raise self._start_error

    def _start_in_background(self, ports: list[int]) -> None:
        try:
            self._start_ports(ports)
        except BaseException as exc:  # noqa: BLE001 - handed to wait(), which raises it in the caller
            self._start_error = exc if isinstance(exc, Exception) else VLLMLaunchError(f"vLLM start ended: {exc!r}")
            if not isinstance(exc, _StoppedWhileStarting):
                log.error("starting the vLLM servers failed: %s", exc)

    def _start_ports(self, ports: list[int]) -> None:
        for port in ports:
            if self._stopping:
                raise _StoppedWhileStarting("the vLLM servers were stopped while they were starting")
            self.ports.append(port)  # registered before the script runs: an interrupt or stop() still stops it
            log.info("starting a vLLM server for %s on port %d", self.model_dir, port)
            try:
                proc = subprocess.run(["bash", str(_SCRIPTS / "start_vllm.sh"), self.model_dir, str(port),
                                       *self.extra_args], env=self._env(), capture_output=True, text=True,
                                      check=False)
            except BaseException:
                self.stop()
                raise
            if self._stopping:  # stop() ran while this script started the server
                if port in self.ports:  # registered after stop() took the list: stopped here
                    self.ports.remove(port)
                    self._stop_ports([port])
                raise _StoppedWhileStarting("the vLLM servers were stopped while they were starting")
            if proc.returncode != 0:
                self.stop()
                raise VLLMLaunchError(f"scripts/start_vllm.sh {self.model_dir} {port} failed (exit "
                                      f"{proc.returncode}):\n{proc.stderr[-4000:]}")

    def stop(self) -> None:
        """Stops every server this object started (SIGTERM, then SIGKILL to its process group); a background
        start still running stops at its current server, which is stopped too."""
        self._stopping = True
        ports, self.ports = self.ports, []
        self._stop_ports(ports)
        starting, self._starting = self._starting, None
        if starting is not None and starting is not threading.current_thread():
            starting.join(timeout=60)  # its script sees the server gone and ends

    def _stop_ports(self, ports: list[int]) -> None:
        for port in ports:
            proc = subprocess.run(["bash", str(_SCRIPTS / "stop_vllm.sh"), str(port)], env=self._env(),
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                log.warning("stopping the vLLM server on port %d failed: %s", port, proc.stderr[-2000:])

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stops a vLLM server's process group when its launcher dies.")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("watch", help="run the watchdog (started by scripts/start_vllm.sh)")
    cmd.add_argument("--parent-pid", type=int, required=True, help="the launching process")
    cmd.add_argument("--parent-start", default="",
                     help="its start time (/proc/PID/stat field 22); empty: pid liveness only")
    cmd.add_argument("--group", type=int, required=True, help="the server's process group id")
    cmd.add_argument("--poll", type=float, default=1.0)
    cmd.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    cmd.add_argument("--pid-file", default="", help="this watchdog's pid file, removed when it ends")
    args = parser.parse_args(argv)
    try:
        watch(args.parent_pid, int(args.parent_start) if args.parent_start else None, args.group,
              poll=args.poll, grace=args.grace)
    finally:
        if args.pid_file:
            try:
                os.remove(args.pid_file)
            except FileNotFoundError:
                pass
    return 0


__all__ = ["LocalVLLMServers", "VLLMLaunchError", "group_alive", "process_start_time", "watch"]

if __name__ == "__main__":  # the watchdog, run by scripts/start_vllm.sh with vLLM's python (`python -I this_file`)
    sys.exit(main())

"""Docker sandbox backend: a pool of long-lived, locked-down containers (the production backend).

Containers come from the image built by scripts/build_sandbox_image.sh (python3 only, no shell) and run with
no network (`network_mode=none`), a read-only root, size-limited /tmp and /dev/shm tmpfs, a private IPC
namespace, every capability dropped but SETUID/SETGID (which only root processes hold: the host's wrapper
and cleaner), `no-new-privileges`, and memory / pids / CPU limits. Three uids take part:

- PID 1 (inside.py, mode "keeper") drops from root to KEEPER_UID at its start: it reaps orphans, and exits when its stdin reaches
  EOF. The host attaches to that stdin when it creates the container (StdinOnce) and never writes to it, so
  when the owning process dies, even by SIGKILL, the stream closes, PID 1 exits and Docker removes the
  container (AutoRemove): no container outlives its trainer;
- user code always runs as RUN_UID (65534), which can neither signal nor trace PID 1 or the root wrapper;
- the one-shot wrapper and the cleaner run as root through `docker exec` and use only SETUID/SETGID.

One-shot runs (`run`) reuse warm containers. The code goes to the wrapper over the exec's stdin, closed
after it (a half-close of the hijacked stream, which dockerd passes on as EOF), never as arguments: every
process in the container can read the wrapper's /proc/PID/cmdline, and a program such as the unit-test
judge holds what the code it runs must not see. After each run the wrapper kills every process of RUN_UID;
then, before the container goes back to the pool, a clean (inside.py, mode "clean") kills whatever is left,
empties /tmp, /dev/shm and /dev/mqueue at any depth and mode, removes SysV IPC objects and verifies all of
it. A clean that fails or cannot verify itself retires the container (destroyed and replaced, counted in
`clean_failures` and logged). After a timeout, an output flood, a cancellation or any failure the
container is destroyed instead (an exec cannot be killed through the API) and the pool replaces it.
Sessions (`open_session`) take a container for their whole life and destroy it at the end.

The pool is a ResourceManager pool ("containers"): warm size, max size, idle reaping, waiting with a timeout
when all containers are busy, and metrics, all from the manager. Exec output is read over a hijacked HTTP
connection on the Docker socket with asyncio (no thread per running exec); container lifecycle calls use the
Docker SDK in a small thread pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import os
import socket
import time
import urllib.parse

from agentfly_jax.envs.manager import EnvironmentCreationError, PoolTimeoutError, ResourceManager
from agentfly_jax.envs.sandbox.common import (
    INSIDE_SOURCE,
    MiB,
    CappedBuffer,
    ExecResult,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
    describe_exit,
)
from agentfly_jax.envs.sandbox.session import PythonSession, Transport

log = logging.getLogger(__name__)

DEFAULT_IMAGE = os.environ.get("AGENTFLY_SANDBOX_IMAGE", "agentfly-jax-sandbox:1")
LABEL = "org.agentfly-jax.sandbox"
OWNER_LABEL = "org.agentfly-jax.owner"
RUN_UID = 65534
USER = f"{RUN_UID}:{RUN_UID}"  # user code (one-shot children, sessions)
KEEPER_UID = 65533  # PID 1, after it dropped root
ROOT_USER = "0:0"  # the one-shot wrapper and the cleaner (capabilities SETUID/SETGID only)
ENVIRONMENT = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
MAX_CODE_BYTES = 1 << 20


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def docker_address() -> str:
    """The daemon address the docker SDK would use (DOCKER_HOST, else the default unix socket)."""
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


#: Attached stdin streams of this process's containers (see `_attach_keepalive`).
_KEEPALIVES: set[socket.socket] = set()


def _close_inherited_keepalives() -> None:
    """In a child made by fork: drops its copies of the keep-alive streams, so the containers still die
    with the process that owns them, not with the last of its forked children."""
    for sock in list(_KEEPALIVES):
        sock.close()
    _KEEPALIVES.clear()


os.register_at_fork(after_in_child=_close_inherited_keepalives)


def _attach_keepalive(address: str, api_version: str, container_id: str) -> socket.socket:
    """Attaches to a created container's stdin and returns the open stream (a blocking socket).

    The container is created with StdinOnce, so Docker closes its PID 1's stdin when this stream closes,
    which happens when this process closes it or dies in any way; the keeper then exits."""
    url = urllib.parse.urlparse(address)
    if url.scheme == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target = url.path
    elif url.scheme in ("tcp", "http"):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        target = (url.hostname, url.port or 2375)
    else:
        raise SandboxUnavailable(f"Docker address {address!r} is not supported; use unix:// or tcp://")
    try:
        sock.settimeout(60)
        sock.connect(target)
        sock.sendall(
            (
                f"POST /v{api_version}/containers/{container_id}/attach?stream=1&stdin=1 HTTP/1.1\r\n"
                f"Host: docker\r\nConnection: Upgrade\r\nUpgrade: tcp\r\nContent-Length: 0\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            data = sock.recv(4096)
            if not data or len(head) > 65536:
                raise SandboxError(
                    f"docker attach to {container_id[:12]}: no complete answer ({head[:200]!r})"
                )
            head += data
        status = head.split(b"\r\n", 1)[0].split()
        if len(status) < 2 or status[1] not in (b"101", b"200"):
            raise SandboxError(f"docker attach to {container_id[:12]} failed: {head[:500]!r}")
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    _KEEPALIVES.add(sock)
    return sock


class _Container:
    """A pooled container, as a ResourceManager instance; `retired` ones are destroyed on release."""

    def __init__(self, sandbox: "DockerSandbox", container_id: str):
        self.sandbox = sandbox
        self.id = container_id
        self.retired = False
        self.runs = 0

    async def health(self) -> bool:
        """True while the container runs (its keeper may have died, e.g. killed for memory)."""
        try:
            state = await self.sandbox._call(self.sandbox._client.api.inspect_container, self.id)
        except Exception:  # noqa: BLE001 - gone or daemon error: not healthy either way
            return False
        return bool(state["State"].get("Running"))

    async def reset(self) -> None:
        """Cleans the container for the next run (session containers are retired, never reset); raises
        SandboxError when the clean fails, so that the pool destroys and replaces the container."""
        if self.runs:
            await self.sandbox._clean(self)

    async def close(self) -> None:
        await self.sandbox._remove(self.id)

    def __repr__(self) -> str:
        return f"container {self.id[:12]}"


class _ExecStream:
    """The attached stdin/stdout/stderr of a `docker exec`, read as Docker's multiplexed frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, address: str, api_version: str, exec_id: str) -> "_ExecStream":
        url = urllib.parse.urlparse(address)
        if url.scheme == "unix":
            reader, writer = await asyncio.open_unix_connection(url.path, limit=1 << 20)
        elif url.scheme in ("tcp", "http"):
            reader, writer = await asyncio.open_connection(url.hostname, url.port or 2375, limit=1 << 20)
        else:
            raise SandboxUnavailable(f"Docker address {address!r} is not supported; use unix:// or tcp://")
        body = b'{"Detach": false, "Tty": false}'
        writer.write(
            (
                f"POST /v{api_version}/exec/{exec_id}/start HTTP/1.1\r\nHost: docker\r\n"
                f"Content-Type: application/json\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        await writer.drain()
        status = await reader.readline()
        while (await reader.readline()).strip():
            pass
        parts = status.split()
        if len(parts) < 2 or parts[1] not in (b"101", b"200"):
            detail = (await reader.read(4096)).decode(errors="replace")
            writer.close()
            raise SandboxError(
                f"docker exec start failed: {status.decode(errors='replace').strip()} {detail}"
            )
        return cls(reader, writer)

    async def read_frame(self) -> tuple[int, bytes] | None:
        """(stream: 1 stdout / 2 stderr, data), or None at the end of the stream."""
        try:
            header = await self.reader.readexactly(8)
            return header[0], await self.reader.readexactly(int.from_bytes(header[4:8], "big"))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def close_stdin(self) -> None:
        """Half-closes the stream (shutdown SHUT_WR once what was written is sent): dockerd closes the
        exec's stdin, which then reads EOF, while its output keeps coming."""
        self.writer.write_eof()

    def close(self) -> None:
        self.writer.close()


class _DockerTransport(Transport):
    """A session running as a `docker exec` in a container it owns."""

    def __init__(
        self,
        sandbox: "DockerSandbox",
        container: _Container,
        lease,
        stream: _ExecStream,
        exec_id: str,
        max_line: int,
    ):
        self.sandbox = sandbox
        self.container = container
        self.lease = lease
        self.stream = stream
        self.exec_id = exec_id
        self.max_line = max_line
        self._buffer = bytearray()
        self._diag = CappedBuffer(8192)
        self._terminated = False

    async def write(self, data: bytes) -> None:
        await self.stream.write(data)

    async def readline(self) -> bytes:
        while True:
            newline = self._buffer.find(b"\n")
            if newline >= 0:
                line = bytes(self._buffer[: newline + 1])
                del self._buffer[: newline + 1]
                return line
            if len(self._buffer) > self.max_line:
                raise ValueError(f"a reply line exceeded {self.max_line} bytes")
            frame = await self.stream.read_frame()
            if frame is None:
                return b""
            kind, data = frame
            if kind == 2:
                self._diag.feed(data)
            else:
                self._buffer += data

    async def terminate(self) -> None:
        self.terminate_soon()
        await asyncio.sleep(0)

    def terminate_soon(self) -> None:
        if self._terminated:
            return
        self._terminated = True
        self.container.retired = (
            True  # never reuse a session's container: its state and processes stay inside
        )
        self.stream.close()
        self.sandbox._spawn(self.lease.__aexit__(None, None, None))

    async def death_reason(self) -> str:
        code = await self.sandbox._exit_code(self.exec_id)
        try:
            state = await self.sandbox._call(
                lambda: self.sandbox._client.api.inspect_container(self.container.id)
            )
            oom = bool(state["State"].get("OOMKilled"))
        except Exception:  # noqa: BLE001 - the container may already be gone
            oom = False
        return describe_exit(code, oom, self._diag.text())


class DockerSandbox:
    """Runs Python in pooled Docker containers; see the module docstring. Belongs to one event loop.

    limits: SandboxLimits (container memory = 2 x memory_bytes + tmp_bytes, pids_limit = max_processes).
    image: the sandbox image (scripts/build_sandbox_image.sh builds the default).
    warm / max_containers: containers kept ready / at most alive; idle ones above `warm` go after
      idle_timeout seconds. acquire_timeout: how long a run waits for a container when all are busy.
    clean_timeout: seconds the clean between two runs may take; a slower clean retires the container.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        image: str = DEFAULT_IMAGE,
        base_url: str | None = None,
        warm: int = 2,
        max_containers: int = 8,
        acquire_timeout: float = 120.0,
        idle_timeout: float = 300.0,
        clean_timeout: float = 20.0,
    ):
        if not clean_timeout > 0:
            raise ValueError(f"clean_timeout={clean_timeout!r}; expected positive seconds")
        self.limits = limits or SandboxLimits()
        self.clean_timeout = clean_timeout
        #: Cleans between runs that failed (their containers were destroyed and replaced).
        self.clean_failures = 0
        self.cleans = 0
        self.image = image
        self.base_url = base_url or docker_address()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_containers + 4, thread_name_prefix="agentfly-docker"
        )
        self._client = None
        self._api_version = None
        self._ready_lock: asyncio.Lock | None = None
        self._live: set[str] = set()
        self._keepalive: dict[str, socket.socket] = {}  # container id -> attached stdin of its PID 1
        self._background: set[asyncio.Task] = set()
        self._closed = False
        self._max_containers = max_containers
        self.pool = ResourceManager(
            {
                "containers": {
                    "factory": self._new_container,
                    "min_size": warm,
                    "max_size": max_containers,
                    "idle_timeout": idle_timeout,
                    "acquire_timeout": acquire_timeout,
                    "create_timeout": 120.0,
                    "close_timeout": 60.0,
                    "reset_timeout": clean_timeout + 30.0,
                    "reset_on_release": True,
                }
            }
        )

    # ------------------------------------------------------------------------------------------- daemon

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(fn, *args, **kwargs)
        )

    async def _ensure_ready(self) -> None:
        if self._closed:
            raise SandboxError("this DockerSandbox is closed; create a new one (or call get_sandbox again)")
        if self._client is not None:
            return
        if self._ready_lock is None:
            self._ready_lock = asyncio.Lock()
        async with self._ready_lock:
            if self._client is None:
                self._client = await self._call(self._connect)
                self._api_version = self._client.api.api_version
                await self.pool.start()

    def _connect(self):
        import docker

        try:
            client = docker.DockerClient(
                base_url=self.base_url, version="auto", timeout=120, max_pool_size=self._max_containers + 8
            )
            client.ping()
        except Exception as e:  # noqa: BLE001 - any failure here means "no usable daemon"
            raise SandboxUnavailable(
                f"no Docker daemon answers at {self.base_url} ({e}); start one with scripts/start_docker.sh "
                f"(as root), or use backend='bwrap'"
            ) from e
        try:
            client.images.get(self.image)
        except docker.errors.ImageNotFound:
            raise SandboxUnavailable(
                f"Docker image {self.image!r} not found; build it with scripts/build_sandbox_image.sh"
            ) from None
        self._remove_stale(client)
        return client

    @staticmethod
    def _remove_stale(client) -> None:
        """Removes sandbox containers left by dead processes of this host (e.g. after a crash)."""
        import docker

        host = socket.gethostname()
        for container in client.api.containers(all=True, filters={"label": LABEL}):
            owner_host, _, pid = (container.get("Labels") or {}).get(OWNER_LABEL, "").rpartition(":")
            if owner_host != host or not pid.isdigit():
                continue
            try:
                os.kill(int(pid), 0)
                continue  # its owner is alive
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            log.warning("removing sandbox container %s left by dead process %s", container["Id"][:12], pid)
            try:
                client.api.remove_container(container["Id"], force=True)
            except docker.errors.NotFound:
                pass  # gone meanwhile (its keeper exited and Docker removed it)
            except docker.errors.APIError as e:
                if e.status_code != 409:  # 409: a removal is already under way
                    raise

    async def _new_container(self) -> _Container:
        limits = self.limits
        api = self._client.api

        def create() -> str:
            from docker.types import Ulimit

            host_config = api.create_host_config(
                network_mode="none",
                read_only=True,
                auto_remove=True,
                cap_drop=["ALL"],
                cap_add=["SETUID", "SETGID"],
                security_opt=["no-new-privileges"],
                mem_limit=2 * limits.memory_bytes + limits.tmp_bytes,
                memswap_limit=2 * limits.memory_bytes + limits.tmp_bytes,
                pids_limit=limits.max_processes,
                nano_cpus=int(limits.cpus * 1e9),
                tmpfs={"/tmp": f"rw,nosuid,nodev,size={limits.tmp_bytes},mode=1777"},
                shm_size=limits.tmp_bytes,
                ipc_mode="private",
                ulimits=[
                    Ulimit(name="nofile", soft=limits.open_files, hard=limits.open_files),
                    Ulimit(name="fsize", soft=limits.file_size_bytes, hard=limits.file_size_bytes),
                    Ulimit(name="core", soft=0, hard=0),
                ],
            )
            container = api.create_container(
                self.image,
                command=["python3", "-I", "-c", INSIDE_SOURCE, "keeper", str(KEEPER_UID)],
                # Root only to start: Docker gives an exec capabilities only when the container's user is
                # root; the keeper drops to KEEPER_UID at once, user code always runs as RUN_UID.
                user=ROOT_USER,
                working_dir="/tmp",
                environment=ENVIRONMENT,
                network_disabled=True,
                stdin_open=True,
                detach=False,  # with stdin_open: StdinOnce, the keeper's stdin closes when our stream does
                host_config=host_config,
                labels={LABEL: "1", OWNER_LABEL: _owner()},
            )
            cid = container["Id"]
            self._live.add(cid)
            try:
                # Attached before the start, held until removal, never written: its EOF (this process
                # closing it, or dying) ends PID 1 and with it the container.
                self._keepalive[cid] = _attach_keepalive(self.base_url, self._api_version, cid)
                api.start(cid)
            except Exception:
                self._remove_sync(api, cid)
                raise
            return cid

        return _Container(self, await self._call(create))

    def _remove_sync(self, api, cid: str) -> None:
        """Force-removes a container and waits until it is gone (another removal may be under way)."""
        import docker

        deadline = time.monotonic() + 60
        while True:
            try:
                api.remove_container(cid, force=True)
                break
            except docker.errors.NotFound:
                break
            except docker.errors.APIError as e:
                if e.status_code != 409 or time.monotonic() > deadline:  # 409: removal already in progress
                    raise
                time.sleep(0.1)
        self._live.discard(cid)
        keepalive = self._keepalive.pop(cid, None)
        if keepalive is not None:
            _KEEPALIVES.discard(keepalive)
            keepalive.close()

    async def _remove(self, cid: str) -> None:
        await self._call(self._remove_sync, self._client.api, cid)

    async def _exit_code(self, exec_id: str) -> int | None:
        for _ in range(50):
            info = await self._call(self._client.api.exec_inspect, exec_id)
            if not info.get("Running") and info.get("ExitCode") is not None:
                return info["ExitCode"]
            await asyncio.sleep(0.02)
        return None

    async def _exec(
        self, container: _Container, command: list[str], stdin: bool, user: str = USER
    ) -> tuple[str, _ExecStream]:
        created = await self._call(
            self._client.api.exec_create,
            container.id,
            command,
            stdin=stdin,
            stdout=True,
            stderr=True,
            user=user,
            workdir="/tmp",
            environment=ENVIRONMENT,
        )
        return created["Id"], await _ExecStream.open(self.base_url, self._api_version, created["Id"])

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _acquire(self):
        return self.pool.acquire("containers")

    async def _clean(self, container: _Container) -> None:
        """Runs the in-container clean (see the module docstring); raises SandboxError unless it verified
        that nothing of the previous run is left. Failures are counted and logged."""
        command = ["python3", "-I", "-c", INSIDE_SOURCE, "clean", str(RUN_UID), str(self.clean_timeout)]
        out, err = CappedBuffer(1 << 16), CappedBuffer(1 << 16)
        self.cleans += 1
        try:
            exec_id, stream = await self._exec(container, command, stdin=False, user=ROOT_USER)
            try:
                await asyncio.wait_for(self._pump(stream, out, err), self.clean_timeout + 10.0)
            finally:
                stream.close()
            code = await self._exit_code(exec_id)
            try:
                verdict = json.loads(out.text().strip().splitlines()[-1])
            except (ValueError, IndexError):
                verdict = {"ok": False, "problems": [f"no verdict; stderr: {err.text().strip()[-500:]!r}"]}
            if code != 0 or verdict.get("ok") is not True:
                raise SandboxError(f"exit status {code}: {'; '.join(verdict.get('problems') or [])}")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure means the container cannot be trusted
            self.clean_failures += 1
            log.warning(
                "docker sandbox: clean of %r failed (%s); retiring it (%d clean failures so far)",
                container,
                e,
                self.clean_failures,
            )
            raise SandboxError(f"clean of {container!r} failed: {e}") from e

    # ---------------------------------------------------------------------------------------------- runs

    async def run(self, code: str, timeout: float = 10.0) -> ExecResult:
        """Runs `code` as a fresh `python3 -I -` in a pooled container (see the module docstring)."""
        data = code.encode("utf-8", "surrogatepass")
        if len(data) > MAX_CODE_BYTES:
            raise ValueError(
                f"code is larger than {MAX_CODE_BYTES // MiB} MiB ({len(data)} bytes in UTF-8); the docker "
                "backend accepts up to that size"
            )
        await self._ensure_ready()
        command = [
            "python3",
            "-I",
            "-c",
            INSIDE_SOURCE,
            "oneshot",
            str(RUN_UID),
            self.limits.rlimits_json(nproc=False, cpu_seconds=timeout + 1),
            str(timeout + 1.0),
            str(len(data)),
            str(MAX_CODE_BYTES),
        ]
        out = CappedBuffer(self.limits.max_output_bytes)
        err = CappedBuffer(self.limits.max_output_bytes)
        notes = []
        timed_out = False
        try:
            async with self._acquire() as container:
                start = time.monotonic()
                container.runs += 1
                try:
                    exec_id, stream = await self._exec(container, command, stdin=True, user=ROOT_USER)
                    try:
                        await asyncio.wait_for(self._feed_and_pump(stream, data, out, err), timeout)
                    except asyncio.TimeoutError:
                        timed_out = True
                        container.retired = True
                        notes.append(
                            f"[sandbox] timed out after {timeout:g} s; the container and every "
                            f"process in it were destroyed"
                        )
                    except _OutputFlood:
                        container.retired = True
                        notes.append(
                            f"[sandbox] output exceeded {self.limits.output_kill_bytes // MiB} MiB; "
                            f"the container was destroyed"
                        )
                    finally:
                        stream.close()
                    exit_code = 137 if container.retired else await self._exit_code(exec_id)
                except BaseException:
                    container.retired = True  # cancelled or failed mid-run: its state is unknown
                    raise
                if exit_code is None or exit_code == 137:
                    container.retired = True  # killed (e.g. out of memory): do not trust the container
                    exit_code = 137 if exit_code is None else exit_code
                elapsed = time.monotonic() - start
        except (EnvironmentCreationError, PoolTimeoutError) as e:
            raise SandboxError(f"docker sandbox: {e}") from e
        stderr = err.text()
        if notes:
            stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + "\n".join(notes) + "\n"
        return ExecResult(
            stdout=out.text(), stderr=stderr, exit_code=exit_code, timed_out=timed_out, elapsed_s=elapsed
        )

    async def _feed_and_pump(
        self, stream: _ExecStream, data: bytes, out: CappedBuffer, err: CappedBuffer
    ) -> None:
        """Sends the code on the exec's stdin and closes it, while reading the output (a wrapper that
        refuses the code or ends early must not leave the write waiting)."""

        async def feed():
            try:
                await stream.write(data)
                stream.close_stdin()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the wrapper ended before reading it all; its exit status and stderr say why

        feeding = asyncio.ensure_future(feed())
        try:
            await self._pump(stream, out, err)
            await feeding
        finally:
            feeding.cancel()

    async def _pump(self, stream: _ExecStream, out: CappedBuffer, err: CappedBuffer) -> None:
        kill_bytes = self.limits.output_kill_bytes
        while (frame := await stream.read_frame()) is not None:
            kind, data = frame
            (err if kind == 2 else out).feed(data)
            if out.total + err.total > kill_bytes:
                raise _OutputFlood

    async def open_session(self) -> PythonSession:
        """Starts a persistent Python session in a container of its own (destroyed when the session ends)."""
        await self._ensure_ready()
        lease = self._acquire()
        try:
            container = await lease.__aenter__()
        except (EnvironmentCreationError, PoolTimeoutError) as e:
            raise SandboxError(f"docker sandbox: {e}") from e
        try:
            command = ["python3", "-I", "-c", INSIDE_SOURCE, "session", self.limits.rlimits_json(nproc=False)]
            exec_id, stream = await self._exec(container, command, stdin=True)
        except BaseException:
            container.retired = True
            await lease.__aexit__(None, None, None)
            raise
        max_line = 16 * self.limits.max_output_bytes + (1 << 20)
        return PythonSession(_DockerTransport(self, container, lease, stream, exec_id, max_line), self.limits)

    # ----------------------------------------------------------------------------------------- shutdown

    async def close(self) -> None:
        """Destroys every container of this sandbox and waits for it; idempotent."""
        self._closed = True
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        await self.pool.close()
        # A creation cancelled by the close goes on in its thread: wait for it, then remove what it made.
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
        if self._live:
            await asyncio.to_thread(self._remove_all_sync)

    def _remove_all_sync(self) -> None:
        for cid in list(self._live):
            try:
                self._remove_sync(self._client.api, cid)
            except Exception as e:  # noqa: BLE001 - best effort; reported
                log.warning("could not remove sandbox container %s: %r", cid[:12], e)

    def close_sync(self) -> None:
        """Removes this sandbox's containers without an event loop (at exit, or after the loop closed)."""
        self._closed = True
        self._executor.shutdown(wait=True)
        if self._client is not None:
            self._remove_all_sync()

    def live_containers(self) -> list[str]:
        """Ids of this sandbox's containers that still exist."""
        return sorted(self._live)


def sandbox_containers(base_url: str | None = None) -> list[dict]:
    """Every container on the daemon carrying the sandbox label (any owner), as {"id", "owner", "status"}."""
    import docker

    client = docker.DockerClient(base_url=base_url or docker_address(), version="auto")
    try:
        # One listing call (not one inspect per container, which fails for a container removed meanwhile).
        return [
            {"id": c["Id"], "owner": (c.get("Labels") or {}).get(OWNER_LABEL), "status": c.get("State")}
            for c in client.api.containers(all=True, filters={"label": LABEL})
        ]
    finally:
        client.close()


class _OutputFlood(Exception):
    pass


__all__ = ["DockerSandbox", "DEFAULT_IMAGE", "LABEL", "sandbox_containers", "docker_address"]

"""bubblewrap sandbox backend: no daemon, ≈ 50 ms per start.

Each run or session gets a *slot*: a dedicated unprivileged uid (users `agentfly-sb*`, created by
scripts/setup_sandbox.sh) plus, where cgroup v1 is writable, its own memory / pids / cpu cgroups. The process
is started as

    sh (joins the slot's cgroups) -> prlimit (rlimits) -> setpriv (slot uid, no groups) -> bwrap -> python3

and bwrap gives it new user, pid, network, ipc and uts namespaces, a read-only /usr, a private size-limited
/tmp, a read-only /dev and nothing else of the host (no /home, no /root, no repository, no sockets). Because
the uid belongs to the slot alone, RLIMIT_NPROC bounds the slot's processes, and "kill every process of this
uid" kills exactly the sandbox's process tree, wherever it forked to. A slot is reused only once no process
of its uid is left; otherwise the uid is quarantined.

Slots are process-global and independent of the event loop; across processes, a lock file per uid keeps
two processes from using one uid at the same time.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import logging
import os
import pathlib
import pwd
import shutil
import signal
import tempfile
import threading
import time

from agentfly_jax.envs.sandbox.common import (
    INSIDE_SOURCE,
    MiB,
    CappedBuffer,
    ExecResult,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
    describe_exit,
    shell_exit_status,
)
from agentfly_jax.envs.sandbox.session import PythonSession, Transport

log = logging.getLogger(__name__)

#: Sandbox users are the accounts whose name starts with this (created by scripts/setup_sandbox.sh).
SANDBOX_USER_PREFIX = "agentfly-sb"

_ATTACH_TO_CGROUPS = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
)


def sandbox_uids() -> list[tuple[int, int]]:
    """(uid, gid) of every sandbox user on this machine, sorted by uid."""
    return sorted((p.pw_uid, p.pw_gid) for p in pwd.getpwall() if p.pw_name.startswith(SANDBOX_USER_PREFIX))


#: how long a slot's release keeps killing its uid's processes before it quarantines the uid
KILL_DEADLINE_S = 5.0


def processes_of_uids(uids) -> dict[int, int]:
    """{pid: uid} of every process (zombies included) whose real uid is in `uids`, from /proc."""
    uids = set(uids)
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        uid = int(line.split()[1])
                        if uid in uids:
                            found[int(name)] = uid
                        break
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


class _Cgroups:
    """Per-uid cgroup v1 directories (memory, pids, cpu) under this process's own cgroups."""

    CONTROLLERS = ("memory", "pids", "cpu")

    def __init__(self, roots: dict[str, pathlib.Path]):
        self.roots = roots

    @classmethod
    def detect(cls) -> "_Cgroups | None":
        """The writable v1 hierarchies of this machine, or None (cgroup v2 only, read-only, not root)."""
        mounts = pathlib.Path("/sys/fs/cgroup")
        own = {}
        try:
            for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
                _, controllers, path = line.split(":", 2)
                for controller in controllers.split(","):
                    own[controller] = path
        except OSError:
            return None
        roots = {}
        for controller in cls.CONTROLLERS:
            hierarchy = mounts / controller
            if controller not in own or not (hierarchy / "cgroup.procs").exists():
                continue
            root = hierarchy / own[controller].lstrip("/") / "agentfly-sandbox"
            try:
                root.mkdir(exist_ok=True)
            except OSError:
                continue
            roots[controller] = root
        if "memory" not in roots or "pids" not in roots:
            return None
        return cls(roots)

    def prepare(self, uid: int, limits: SandboxLimits) -> list[str]:
        """Creates the uid's cgroups with `limits`; returns their cgroup.procs files."""
        settings = {
            "memory": {"memory.limit_in_bytes": 2 * limits.memory_bytes + limits.tmp_bytes},
            "pids": {"pids.max": limits.max_processes + 8},  # + bwrap's own processes
            "cpu": {"cpu.cfs_period_us": 100_000, "cpu.cfs_quota_us": int(limits.cpus * 100_000)},
        }
        procs = []
        for controller, root in self.roots.items():
            group = root / f"uid-{uid}"
            group.mkdir(exist_ok=True)
            for name, value in settings[controller].items():
                (group / name).write_text(str(value))
            procs.append(str(group / "cgroup.procs"))
        return procs

    def oom_kills(self, uid: int) -> int:
        """How many processes the kernel's OOM killer has killed in the uid's memory cgroup."""
        try:
            text = (self.roots["memory"] / f"uid-{uid}" / "memory.oom_control").read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0


class _UidAllocator:
    """Hands out sandbox uids to any event loop or thread; waiters are served first come, first served."""

    def __init__(self):
        self._lock = threading.Lock()
        self._busy: set[int] = set()
        self._quarantined: set[int] = set()
        self._locks: dict[int, int] = {}
        self._waiters: collections.deque = collections.deque()
        self._lock_dir = (
            pathlib.Path("/run" if os.access("/run", os.W_OK) else tempfile.gettempdir())
            / "agentfly-jax-sandbox"
        )

    def _try_claim(self, candidates) -> tuple[int, int] | None:
        self._lock_dir.mkdir(mode=0o700, exist_ok=True)
        for uid, gid in candidates:
            if uid in self._busy or uid in self._quarantined:
                continue
            fd = os.open(self._lock_dir / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another process uses this uid
                os.close(fd)
                continue
            self._busy.add(uid)
            self._locks[uid] = fd
            return uid, gid
        return None

    async def claim(self, candidates, timeout: float) -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        with self._lock:
            got = self._try_claim(candidates)
            if got is not None:
                return got
            waiter = loop.create_future()
            entry = (loop, waiter, candidates)
            self._waiters.append(entry)
        try:
            # Uids held by other processes free up without a release here: poll for them as well.
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                try:
                    return await asyncio.wait_for(asyncio.shield(waiter), min(remaining, 0.5))
                except asyncio.TimeoutError:
                    with self._lock:
                        if waiter.done():
                            continue
                        got = self._try_claim(candidates)
                        if got is not None:
                            waiter.set_result(got)
        except BaseException:
            with self._lock:
                try:
                    self._waiters.remove(entry)
                except ValueError:
                    pass
                handed = waiter.done() and not waiter.cancelled() and waiter.exception() is None
                if not waiter.done():
                    waiter.cancel()
            if handed:
                self.release(waiter.result()[0])
            raise

    def release(self, uid: int, quarantine: bool = False) -> None:
        with self._lock:
            if quarantine:
                self._quarantined.add(uid)
            fd = self._locks.pop(uid, None)
            if fd is not None:
                os.close(fd)
            self._busy.discard(uid)
            if quarantine:
                return
            while self._waiters:
                loop, waiter, candidates = self._waiters[0]
                if waiter.done() or loop.is_closed():
                    self._waiters.popleft()
                    continue
                got = self._try_claim(candidates)
                if got is None:
                    return
                self._waiters.popleft()
                loop.call_soon_threadsafe(self._hand_over, waiter, got)
                return

    def _hand_over(self, waiter: asyncio.Future, got: tuple[int, int]) -> None:
        with self._lock:
            if not waiter.done():
                waiter.set_result(got)
                return
        self.release(got[0])  # the waiter gave up meanwhile

    @property
    def quarantined(self) -> set[int]:
        return set(self._quarantined)


_ALLOCATOR = _UidAllocator()


class _Slot:
    """One claimed uid (+ cgroups) and the process started in it."""

    def __init__(self, sandbox: "BwrapSandbox", uid: int, gid: int):
        self.sandbox = sandbox
        self.uid, self.gid = uid, gid
        self.proc: asyncio.subprocess.Process | None = None
        self.released = False

    async def start(
        self, command: list[str], cpu_seconds: float | None = None, **kwargs
    ) -> asyncio.subprocess.Process:
        argv = self.sandbox._launch_argv(self.uid, self.gid, command, cpu_seconds=cpu_seconds)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                **kwargs,
            )
        except OSError as e:
            raise SandboxError(f"could not start bubblewrap ({e}); run scripts/setup_sandbox.sh") from e
        return self.proc

    def kill_now(self) -> list[int]:
        """SIGKILLs every process of the slot's uid except our direct child, so that the child (bwrap's
        monitor) reaps the namespace's init and exits by itself; returns the pids that were found."""
        pids = processes_of_uids([self.uid])
        child = self.proc.pid if self.proc is not None else None
        for pid in pids:
            if pid != child:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return list(pids)

    async def kill_all(self, deadline_s: float = KILL_DEADLINE_S, *, until_child_exits: bool = False) -> bool:
        """Kills the whole process tree of the slot; True once no process of its uid is left, or with
        `until_child_exits` once our direct child (bwrap's monitor) has exited."""
        start = time.monotonic()
        rounds = 0
        while time.monotonic() - start < deadline_s:
            pids = self.kill_now()
            proc = self.proc
            if proc is not None and proc.returncode is None:
                # The monitor exits once the namespace's init is gone; if it lingers, kill it too.
                if rounds >= 3 or len(pids) <= 1:
                    try:
                        proc.kill()
                    except ProcessLookupError:
                        pass
                try:
                    await asyncio.wait_for(proc.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass
            elif not pids or until_child_exits:
                return True
            rounds += 1
            await asyncio.sleep(0.01 if rounds < 10 else 0.05)
        return not processes_of_uids([self.uid])

    async def release(self) -> None:
        """Kills what is left and gives the uid back (or quarantines it when processes survive)."""
        if self.released:
            return
        self.released = True
        clean = False
        try:
            clean = await self.kill_all()
        finally:  # also when cancelled (a loop shutting down): the uid goes back or is quarantined
            if not clean:
                self.kill_now()
                clean = not processes_of_uids([self.uid])
            if not clean:
                log.error("bwrap sandbox uid %d still has processes after SIGKILL; quarantining it", self.uid)
            _ALLOCATOR.release(self.uid, quarantine=not clean)

    async def stop(self) -> None:
        """Ends a run: SIGKILLs the slot's processes until our child (bwrap's monitor) has exited. The
        namespace's processes die with its init (pid 1 inside, the monitor's child); what a fork bomb leaves
        is SIGKILLed and being reaped by the kernel, which on a loaded machine took seconds, and the run's
        result need not wait for that: if any process of the uid is left, the rest of the release goes to a
        background task (`release_soon`: kill and wait for what is still dying, then give the uid back or
        quarantine it). The uid is not handed out again before its release ends."""
        await self.kill_all(until_child_exits=True)
        if processes_of_uids([self.uid]):
            self.release_soon()
        else:  # the usual case: nothing left, the uid goes back now
            await self.release()

    def release_soon(self) -> None:
        """Release from a cancelled or synchronous context: kill now, finish in a background task."""
        if self.released:
            return
        self.kill_now()
        task = asyncio.get_running_loop().create_task(self.release())
        self.sandbox._background.add(task)
        task.add_done_callback(self.sandbox._background.discard)


class _BwrapTransport(Transport):
    """A session's python process in a slot: protocol over its stdin/stdout."""

    def __init__(self, slot: _Slot, proc: asyncio.subprocess.Process, diagnostics_bytes: int = 8192):
        self.slot = slot
        self.proc = proc
        self._diag = CappedBuffer(diagnostics_bytes)
        self._pump = asyncio.get_running_loop().create_task(self._drain_stderr())
        self._oom0 = slot.sandbox._cgroups.oom_kills(slot.uid) if slot.sandbox._cgroups else 0

    async def _drain_stderr(self) -> None:
        while chunk := await self.proc.stderr.read(65536):
            self._diag.feed(chunk)

    async def write(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        await self.proc.stdin.drain()

    async def readline(self) -> bytes:
        return await self.proc.stdout.readline()

    async def terminate(self) -> None:
        await self.slot.release()
        try:  # the process is gone, so its stderr reaches EOF: let the drain finish cleanly
            await asyncio.wait_for(self._pump, 1.0)
        except (asyncio.TimeoutError, OSError):
            self._pump.cancel()

    def terminate_soon(self) -> None:
        self._pump.cancel()
        self.slot.release_soon()

    async def death_reason(self) -> str:
        try:
            code = await asyncio.wait_for(self.proc.wait(), 1.0)
        except asyncio.TimeoutError:
            code = None
        cgroups = self.slot.sandbox._cgroups
        oom = cgroups is not None and cgroups.oom_kills(self.slot.uid) > self._oom0
        return describe_exit(code, oom, self._diag.text())


class BwrapSandbox:
    """Runs Python under bubblewrap; see the module docstring.

    limits: SandboxLimits for every run and session.
    python: interpreter inside the sandbox (the system Python, with only the standard library and the
      system's dist-packages; the repository and its virtual environment are not visible).
    extra_ro_binds: more host paths to expose read-only at the same place (e.g. a data directory).
    slot_timeout: seconds to wait for a free sandbox uid when all are busy.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        python: str = "/usr/bin/python3",
        extra_ro_binds: tuple[str, ...] = (),
        slot_timeout: float = 120.0,
        use_cgroups: bool = True,
        bwrap: str = "bwrap",
    ):
        self.limits = limits or SandboxLimits()
        self.python = python
        self.slot_timeout = slot_timeout
        self._bwrap = shutil.which(bwrap)
        if self._bwrap is None:
            raise SandboxUnavailable(
                "bubblewrap is not installed (no 'bwrap' on PATH); run scripts/setup_sandbox.sh as root "
                "(or apt-get install bubblewrap), or use backend='docker'"
            )
        for tool in ("setpriv", "prlimit"):
            if shutil.which(tool) is None:
                raise SandboxUnavailable(f"'{tool}' (util-linux) is missing; apt-get install util-linux")
        if os.geteuid() != 0:
            raise SandboxUnavailable(
                "the bwrap backend starts each sandbox as its own unprivileged uid and must run as root "
                "to do so; run as root or use backend='docker'"
            )
        self.uids = sandbox_uids()
        if not self.uids:
            raise SandboxUnavailable(
                f"no sandbox users ('{SANDBOX_USER_PREFIX}*') exist; run scripts/setup_sandbox.sh as root"
            )
        if not os.path.exists(python):
            raise SandboxUnavailable(f"sandbox interpreter {python} does not exist; pass python=...")
        self._cgroups = _Cgroups.detect() if use_cgroups else None
        if self._cgroups is None:
            log.info("bwrap sandbox: no writable cgroup v1 hierarchies; relying on rlimits only")
        self._bwrap_args = self._make_bwrap_args(extra_ro_binds)
        self._background: set[asyncio.Task] = set()
        self._works = False  # set once a sandbox has started here (see _check_works)

    @property
    def slots(self) -> int:
        return len(self.uids)

    def _make_bwrap_args(self, extra_ro_binds) -> list[str]:
        lim = self.limits
        args = [
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--as-pid-1",
            "--clearenv",
            "--cap-drop",
            "ALL",
            "--hostname",
            "sandbox",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        for top in ("bin", "sbin", "lib", "lib32", "lib64"):  # merged-/usr symlinks, or plain directories
            path = pathlib.Path("/") / top
            if path.is_symlink():
                args += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                args += ["--ro-bind", str(path), str(path)]
        for path in ("/etc/ld.so.cache", "/etc/localtime", *extra_ro_binds):
            args += ["--ro-bind-try", path, path]
        args += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(lim.tmp_bytes),
            "--perms",
            "1777",
            "--tmpfs",
            "/dev/shm",
            "--size",
            str(lim.tmp_bytes),
            "--perms",
            "1777",
            "--tmpfs",
            "/tmp",
            "--remount-ro",
            "/dev",
            "--remount-ro",
            "/",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/tmp",
            "--setenv",
            "TMPDIR",
            "/tmp",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--chdir",
            "/tmp",
        ]
        return args

    def _launch_argv(
        self, uid: int, gid: int, command: list[str], cpu_seconds: float | None = None
    ) -> list[str]:
        lim = self.limits
        argv = []
        if self._cgroups is not None:
            procs = self._cgroups.prepare(uid, lim)
            argv += ["/bin/sh", "-c", _ATTACH_TO_CGROUPS, "sh", str(len(procs)), *procs]
        # Limits first, while still root (an unprivileged process cannot raise a hard limit), then the uid.
        argv += [
            "prlimit",
            *(f"--{k}={v}" for k, v in lim.rlimits(nproc=True, cpu_seconds=cpu_seconds).items()),
            "--",
        ]
        argv += ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
        return argv + [self._bwrap, *self._bwrap_args, "--", *command]

    async def _claim(self) -> _Slot:
        try:
            uid, gid = await _ALLOCATOR.claim(self.uids, self.slot_timeout)
        except TimeoutError:
            raise SandboxError(
                f"all {len(self.uids)} bwrap sandbox slots stayed busy for {self.slot_timeout:g} s; lower "
                "concurrency, raise slot_timeout, or create more sandbox users (SANDBOX_SLOTS=N "
                "scripts/setup_sandbox.sh)"
            ) from None
        slot = _Slot(self, uid, gid)
        if not self._works:
            try:
                await self._check_works(slot)
            except BaseException:
                await slot.release()
                raise
        return slot

    async def _check_works(self, slot: _Slot) -> None:
        """Starts one empty sandbox, so that a kernel or setup that forbids it (e.g. no unprivileged user
        namespaces) is reported as such instead of as a failing user program."""
        proc = await slot.start([self.python, "-I", "-c", "pass"])
        _, stderr = await asyncio.wait_for(proc.communicate(), 30)
        slot.proc = None
        if proc.returncode != 0:
            raise SandboxUnavailable(
                f"bubblewrap could not start a sandbox here (exit status {proc.returncode}: "
                f"{stderr.decode(errors='replace').strip()[-500:]}); the bwrap backend needs bubblewrap to "
                f"work for unprivileged users (unprivileged user namespaces, sysctl "
                f"user.max_user_namespaces > 0) and the setup of scripts/setup_sandbox.sh; or use "
                f"backend='docker'"
            )
        self._works = True

    async def run(self, code: str, timeout: float = 10.0) -> ExecResult:
        """Runs `code` as a fresh `python3 -I -` (code on stdin) and returns its output and exit status."""
        slot = await self._claim()
        out = CappedBuffer(self.limits.max_output_bytes)
        err = CappedBuffer(self.limits.max_output_bytes)
        notes = []
        timed_out = False
        start = time.monotonic()
        try:
            # RLIMIT_CPU backs up the wall-clock kill: CPU time can never exceed the timeout by much.
            proc = await slot.start([self.python, "-I", "-"], cpu_seconds=timeout + 1)
            try:
                await asyncio.wait_for(
                    self._communicate(proc, code.encode("utf-8", "surrogatepass"), out, err), timeout
                )
            except asyncio.TimeoutError:
                timed_out = True
                notes.append(
                    f"[sandbox] timed out after {timeout:g} s; the process and all its children were killed"
                )
            except _OutputFlood:
                notes.append(
                    f"[sandbox] output exceeded {self.limits.output_kill_bytes // MiB} MiB; the process "
                    f"was killed"
                )
            await slot.stop()
            # The monitor (bwrap) may itself be SIGKILLed when the tree is killed: -9, reported as 137 like a
            # killed child.
            exit_code = shell_exit_status(proc.returncode) if proc.returncode is not None else 137
        except BaseException:
            slot.release_soon()
            raise
        elapsed = time.monotonic() - start
        stderr = err.text()
        if notes:
            stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + "\n".join(notes) + "\n"
        return ExecResult(
            stdout=out.text(), stderr=stderr, exit_code=exit_code, timed_out=timed_out, elapsed_s=elapsed
        )

    async def _communicate(self, proc, data: bytes, out: CappedBuffer, err: CappedBuffer) -> None:
        kill_bytes = self.limits.output_kill_bytes

        async def feed():
            try:
                proc.stdin.write(data)
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass

        async def pump(stream, buf):
            while chunk := await stream.read(65536):
                buf.feed(chunk)
                if out.total + err.total > kill_bytes:
                    raise _OutputFlood

        await asyncio.gather(feed(), pump(proc.stdout, out), pump(proc.stderr, err))
        await proc.wait()

    async def open_session(self) -> PythonSession:
        """Starts a persistent Python session in its own slot (see inside.py, mode "session")."""
        slot = await self._claim()
        try:
            max_line = 16 * self.limits.max_output_bytes + (1 << 20)  # JSON-escaped head + tail of 2 streams
            proc = await slot.start(
                [self.python, "-I", "-c", INSIDE_SOURCE, "session", self.limits.rlimits_json(nproc=True)],
                limit=max_line,
            )
        except BaseException:
            slot.release_soon()
            raise
        return PythonSession(_BwrapTransport(slot, proc), self.limits)

    async def close(self) -> None:
        """Waits for this event loop's background releases (runs and sessions release their own slots)."""
        loop = asyncio.get_running_loop()
        while mine := [t for t in self._background if t.get_loop() is loop]:
            await asyncio.gather(*mine, return_exceptions=True)

    def live_processes(self) -> dict[int, int]:
        """{pid: uid} of every process running as any sandbox uid (for checks and tests)."""
        return processes_of_uids(uid for uid, _ in self.uids)


class _OutputFlood(Exception):
    pass

"""Types shared by the sandbox backends: limits, results, errors and the capped output buffer."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import signal

MiB = 1 << 20

#: Source of the program that runs inside every sandbox (see inside.py); passed with `python3 -I -c`.
INSIDE_SOURCE = (pathlib.Path(__file__).with_name("inside.py")).read_text()


class SandboxError(RuntimeError):
    """A sandbox failed for a reason other than the user's code (setup error, daemon error)."""


class SandboxUnavailable(SandboxError):
    """The backend cannot run here (missing bwrap, no sandbox uids, no Docker daemon or image)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run or session.

    memory_bytes: address-space limit of each process (RLIMIT_AS: allocations beyond it raise MemoryError);
      the sandbox as a whole (cgroup / container) gets 2 x memory_bytes + tmp_bytes as a hard ceiling.
    max_processes: processes + threads of one sandbox (RLIMIT_NPROC per slot uid / pids cgroup / pids_limit).
    file_size_bytes: largest file the code may write (RLIMIT_FSIZE); also caps a session's output.
    tmp_bytes: size of the private, writable /tmp (the only writable place).
    open_files: RLIMIT_NOFILE.
    cpus: CPU cores the sandbox may use (cgroup quota / docker nano_cpus).
    max_output_bytes: bytes of stdout and of stderr kept per run (head and tail; the middle is dropped with a
      note). Output beyond `output_kill_bytes` stops the run.
    """

    memory_bytes: int = 512 * MiB
    max_processes: int = 64
    file_size_bytes: int = 16 * MiB
    tmp_bytes: int = 64 * MiB
    open_files: int = 256
    cpus: float = 1.0
    max_output_bytes: int = 1 * MiB
    output_kill_bytes: int = 32 * MiB

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(
                    f"SandboxLimits.{field.name}={getattr(self, field.name)!r}; must be positive"
                )

    def rlimits(self, *, nproc: bool, cpu_seconds: float | None = None) -> dict[str, int]:
        """The sandbox's rlimits ({"as": ..., ...}); `nproc` only where the uid is the sandbox's own."""
        limits = {
            "as": self.memory_bytes,
            "fsize": self.file_size_bytes,
            "nofile": self.open_files,
            "core": 0,
        }
        if nproc:
            limits["nproc"] = self.max_processes
        if cpu_seconds is not None:
            limits["cpu"] = max(1, int(cpu_seconds + 0.999))
        return limits

    def rlimits_json(self, **kwargs) -> str:
        return json.dumps(self.rlimits(**kwargs))


@dataclasses.dataclass
class ExecResult:
    """Outcome of one `run_python` call.

    stdout / stderr: what the program printed (each capped at the limits' max_output_bytes, head + tail kept,
      with a note where the middle was dropped); sandbox notes (timeout, output limit) end stderr.
    exit_code: the process's exit status; 128 + N when killed by signal N (137: killed, e.g. on timeout or
      out of memory); -1 when the sandbox failed before the code ran.
    timed_out: the run exceeded its timeout and its whole process tree was killed.
    elapsed_s: wall-clock seconds of the run (excluding waiting for a free sandbox).
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclasses.dataclass
class CellResult:
    """Outcome of one code cell in a persistent session.

    value: repr of the cell's last expression (None when there is none or it is None).
    error: traceback text of an exception raised by the cell (None when it succeeded).
    timed_out: the cell exceeded its timeout; `restarted` tells whether the session had to be killed (state
      lost) or the interrupt was enough (state kept).
    restarted: the session process died or was killed during this cell; the next cell starts a fresh one.
    crash: why the session died, when it did (e.g. killed by the memory limit).
    """

    stdout: str = ""
    stderr: str = ""
    value: str | None = None
    error: str | None = None
    timed_out: bool = False
    restarted: bool = False
    crash: str | None = None
    elapsed_s: float = 0.0


def shell_exit_status(returncode: int) -> int:
    """A child's returncode as ExecResult.exit_code reports it: 128 + N when killed by signal N (Python's
    subprocess and asyncio give -N), else the status itself."""
    return 128 - returncode if returncode < 0 else returncode


def truncation_note(dropped: int) -> str:
    return f"\n... [{dropped:,} bytes of output truncated] ...\n"


class CappedBuffer:
    """Keeps the first `head` and last `tail` bytes of a stream and counts the total."""

    def __init__(self, limit: int):
        self.head_limit = limit - limit // 4
        self.tail_limit = limit // 4
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_limit:
            self.tail += data
            if len(self.tail) > 2 * self.tail_limit:  # trim lazily: amortised O(1) per byte
                del self.tail[: -self.tail_limit]

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_limit :]) if self.tail_limit else b""
        dropped = self.total - len(self.head) - len(tail)
        body = bytes(self.head).decode("utf-8", "replace")
        if dropped > 0:
            body += truncation_note(dropped)
        return body + tail.decode("utf-8", "replace")


def join_head_tail(head: str, tail: str, total_bytes: int) -> str:
    """Rebuilds capped output from a session reply's (head, tail, total size)."""
    dropped = total_bytes - len(head.encode("utf-8", "replace")) - len(tail.encode("utf-8", "replace"))
    if dropped > 0:
        return head + truncation_note(dropped) + tail
    return head + tail


def describe_exit(code: int | None, oom: bool, diagnostics: str) -> str:
    """One sentence on why a sandboxed Python process ended (exit status, signal, out-of-memory kill)."""
    if code is None:
        what = "stopped responding"
    elif code >= 128 or code < 0:
        signum = code - 128 if code >= 128 else -code
        try:
            what = f"was killed by {signal.Signals(signum).name}"
        except ValueError:
            what = f"was killed by signal {signum}"
    else:
        what = f"exited with status {code}"
    text = f"the Python process {what}"
    if oom:
        text += " (the sandbox's memory limit was reached)"
    if diagnostics.strip():
        text += f"; it printed: {diagnostics.strip()[-2000:]}"
    return text

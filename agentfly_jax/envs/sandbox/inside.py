"""The program that runs INSIDE a sandbox (bubblewrap or a container). Standard library only.

The host never imports this module: it reads its source and starts it as `python3 -I -c SOURCE MODE ...`
inside the sandbox. Modes:

  session LIMITS_JSON
      A persistent Python session (like a notebook kernel). Requests arrive one JSON object per line on
      stdin ({"id", "code", "timeout", "head", "tail"}); one JSON reply per line goes to stdout ({"id",
      "stdout", "stderr", "value", "error", "timed_out", "elapsed"}, plus "crash" when the session had to
      end). Variables and imports persist across requests. The cells run in a second process (the
      kernel) that never holds the host channel: only this process (the relay) does, and it is
      undumpable, so user code cannot write a reply whatever it does to its own process (the design and
      what it checks: the "session" comment below and agentfly_jax/envs/sandbox/session.py). The user's
      fd 1/2 (print, os.write, child processes) go to memory files that the relay reads, caps (head +
      tail bytes) and empties after each request. A cell that runs past its timeout is interrupted with
      CellTimeout (state is kept); one that ignores the interrupt is killed by the host.

  oneshot RUN_UID LIMITS_JSON TIMEOUT CODE_BYTES MAX_CODE_BYTES
      Started as root (docker exec, capabilities SETUID/SETGID only). Reads the code from its stdin to
      EOF, refusing (exit status 2, before anything runs) more than MAX_CODE_BYTES or another size than
      the announced CODE_BYTES; the code never travels as arguments, since every process in the container
      can read this process's /proc/PID/cmdline. Then runs it with `python3 -I -` in a child process that
      has dropped to RUN_UID (uid and gid) under the limits, so the code can neither trace nor signal this
      wrapper or PID 1; the child's interpreter reads the code from a pipe of its own (to EOF, before the
      code starts, so the code's stdin is that pipe, empty and with its write end closed), never from this
      process's stdin, which is /dev/null by then. Then kills every process of RUN_UID. Exits with the child's exit code (128 + signal number
      when it was killed by a signal).

  clean RUN_UID DEADLINE_S
      Started as root between two runs in a pooled container: kills every process but PID 1 and itself,
      empties every writable place (/tmp, /dev/shm, /dev/mqueue, at any depth and whatever the modes),
      removes SysV shared memory, semaphores and message queues, then checks that all of it is gone. Prints
      one JSON line {"ok", "problems", "removed"}; the host retires the container unless "ok" is true.

  keeper KEEPER_UID
      PID 1 of a pooled container. Started as root, it drops to KEEPER_UID (no capabilities left), reaps
      orphans, and exits (stopping the container, which Docker then removes) when its stdin reaches EOF:
      the host holds the only attached stream to that stdin, so the container dies with its owner process.
"""

import ast
import json
import linecache
import os
import resource
import signal
import sys
import time
import traceback

_RLIMITS = {
    "as": "RLIMIT_AS",
    "nproc": "RLIMIT_NPROC",
    "fsize": "RLIMIT_FSIZE",
    "nofile": "RLIMIT_NOFILE",
    "core": "RLIMIT_CORE",
    "cpu": "RLIMIT_CPU",
}


def apply_limits(limits):
    """Lowers the given rlimits ({"as": bytes, ...}) to min(requested, current hard limit)."""
    for name, value in limits.items():
        which = getattr(resource, _RLIMITS[name])
        _, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))


class CellTimeout(BaseException):
    """Raised inside user code when a cell exceeds its time limit (BaseException: `except Exception`
    in user code does not swallow it)."""


def _on_alarm(signum, frame):
    raise CellTimeout()


def make_undumpable():
    """prctl(PR_SET_DUMPABLE, 0): processes of the same uid can no longer open this process's
    /proc/PID/fd, /proc/PID/mem or environ, nor ptrace it, nor take its descriptors with pidfd_getfd
    (without CAP_SYS_PTRACE, which nothing in a sandbox has). Raises OSError when it cannot."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # 4 = PR_SET_DUMPABLE
        err = ctypes.get_errno()
        raise OSError(err, "prctl(PR_SET_DUMPABLE, 0): %s" % os.strerror(err))


def _collect(fd, head, tail):
    """Reads what the user wrote to memory file `fd` (first `head` + last `tail` bytes), then empties it."""
    size = os.fstat(fd).st_size
    if size <= head + tail:
        first, last = os.pread(fd, size, 0), b""
    else:
        first, last = os.pread(fd, head, 0), os.pread(fd, tail, size - tail)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    return first.decode("utf-8", "replace"), last.decode("utf-8", "replace"), size


def _cap_text(text, head, tail, what):
    """`text` with its middle cut to head + tail characters, with a note on what was cut."""
    if text is None or len(text) <= head + tail:
        return text
    return (
        text[:head]
        + "\n... [%d characters of the %s truncated] ...\n" % (len(text) - head - tail, what)
        + text[-tail:]
    )


def _format_error(error, skip_frames):
    """Traceback text of `error` without this runner's own frames."""
    tb = error.__traceback__
    for _ in range(skip_frames):
        if tb is not None:
            tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def _run_cell(namespace, code, timeout, counter):
    """Executes one cell; returns (value repr or None, error text or None, timed_out)."""
    filename = "<cell %d>" % counter
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        tree = ast.parse(code, filename, "exec")
    except SyntaxError as e:
        return None, "".join(traceback.format_exception_only(type(e), e)), False
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    value = error = None
    timed_out = False
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        exec(compile(tree, filename, "exec"), namespace)
        if last is not None:
            result = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
            if result is not None:
                namespace["_"] = result
                value = repr(result)
    except CellTimeout:
        timed_out = True
    except SystemExit as e:
        error = "SystemExit: %r (the session keeps running)\n" % (e.code,)
    except BaseException as e:  # noqa: B902 - everything the user code raises is reported, never fatal
        error = _format_error(e, skip_frames=1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return value, error, timed_out


# ------------------------------------------------------------------------------------------ session
#
# Two processes. The RELAY is the process the host started: it alone holds the host channel (its fds 0
# and 1), makes itself undumpable, and never runs user code. The KERNEL is a child it forks at the start,
# which runs the cells: its fds 0/1/2 are /dev/null and the two output memory files, and its only link to
# the relay is a unix socket that the relay has shut down for reading (so the kernel can receive on it
# but never send). For each request the relay creates a fresh result pipe and sends the kernel, over the
# socket, the request with three descriptors: the pipe's write end and the two memory files (which the
# kernel puts back on fds 1 and 2, whatever the previous cell did to them). The kernel runs the cell,
# writes one result line (tagged with the request's sequence number) to the pipe and closes it; the
# relay reads the pipe to its end, checks that it holds exactly that one line, reads the captured
# output itself, and writes the reply to the host. Anything else in the pipe (a second line, garbage, a
# wrong sequence number, more than the size limit), a pipe closed without a result while the kernel
# lives, or a kernel's note that the previous cell closed or replaced its pipe, ends the session with a
# reply whose "crash" says so. When the kernel dies, the relay exits with the kernel's status (128 + N
# for signal N) so the host reports it as before.

_RESULT_KEYS = {
    "seq": int,
    "value": (str, type(None)),
    "error": (str, type(None)),
    "timed_out": bool,
}
# The kernel's exit status when its request socket is gone or broken (the relay says so in its reply).
_NO_REQUEST_CHANNEL = 71


def _kernel(sock, stream_encoding, stream_errors):
    """The forked child that runs the cells (see above); never returns."""
    import socket

    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    keep = sock.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    devnull = os.open(os.devnull, os.O_RDWR)  # the first one was closed with the rest
    os.set_inheritable(devnull, False)
    # The interpreter's own stream objects own fds 0/1/2: they stay referenced, so that collecting them
    # never closes those fds.
    streams = {"originals": (sys.stdin, sys.stdout, sys.stderr)}
    sys.stdin = sys.__stdin__ = open(os.devnull)

    def fresh_streams():
        # Our own wrappers (closefd=False): a cell that closes sys.stdout gets working ones next time.
        if "out" not in streams or streams["out"].closed:
            streams["out"] = open(1, "w", encoding=stream_encoding, errors=stream_errors, closefd=False)
        if "err" not in streams or streams["err"].closed:
            streams["err"] = open(
                2,
                "w",
                buffering=1,
                encoding=stream_encoding,
                errors="backslashreplace",
                closefd=False,
            )
        sys.stdout = sys.__stdout__ = streams["out"]
        sys.stderr = sys.__stderr__ = streams["err"]

    current = {"result": None}

    def after_fork_in_child():
        # A fork of the kernel (os.fork, multiprocessing) must not keep the result pipe open, nor read
        # requests meant for the kernel.
        for fd in (current["result"], keep):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    os.register_at_fork(after_in_child=after_fork_in_child)
    signal.signal(signal.SIGALRM, _on_alarm)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    note = None
    while True:
        try:
            header, fds, _flags, _ = socket.recv_fds(sock, 8, 3)
            while header and len(header) < 8:
                more = sock.recv(8 - len(header))
                if not more:
                    header = b""
                header += more
            if not header:
                os._exit(0)  # the relay closed the socket: the session is over
            if len(header) < 8 or len(fds) != 3:
                os._exit(_NO_REQUEST_CHANNEL)
            size = int.from_bytes(header, "big")
            payload = bytearray()
            while len(payload) < size:
                chunk = sock.recv(min(size - len(payload), 1 << 20))
                if not chunk:
                    os._exit(_NO_REQUEST_CHANNEL)
                payload += chunk
            request = json.loads(bytes(payload))
        except OSError:  # a cell closed or replaced the socket's fd, or read from the socket itself
            os._exit(_NO_REQUEST_CHANNEL)
        result_fd, out_fd, err_fd = fds
        os.set_inheritable(result_fd, False)
        current["result"] = result_fd
        identity = os.fstat(result_fd)[1:3]  # (inode, device)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        fresh_streams()
        value, error, timed_out = _run_cell(namespace, request["code"], request["timeout"], request["seq"])
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:  # the cell closed fd 1 or 2: what is still buffered for it is dropped
                os.dup2(devnull, fd)
        for stream in (sys.stdout, sys.stderr, streams["out"], streams["err"]):
            try:
                stream.flush()
            except BaseException:  # noqa: B902 - the user may have closed or replaced the stream
                pass
        head, tail = request["head"], request["tail"]
        result = {
            "seq": request["seq"],
            "value": _cap_text(value, head, tail, "value"),
            "error": _cap_text(error, head, tail, "error"),
            "timed_out": timed_out,
        }
        if note is not None:
            result["tampered"] = note
            note = None
        line = (json.dumps(result) + "\n").encode()
        current["result"] = None
        try:
            if os.fstat(result_fd)[1:3] != identity:
                raise OSError("the result pipe was replaced")
            while line:
                line = line[os.write(result_fd, line) :]
            os.close(result_fd)
        except OSError:
            note = (
                "cell %d closed or replaced the session's result channel (it may have answered in the "
                "runner's place)" % request["seq"]
            )


def reap_exited():
    """(pid, wait status) of every child that has ended, reaped without waiting for the others."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


def _kernel_exit_code(status):
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


class _Relay:
    """The relay's side of one session (see above)."""

    def __init__(self, sock, kernel_pid, out_fd, err_fd):
        self.sock = sock
        self.kernel_pid = kernel_pid
        self.out_fd, self.err_fd = out_fd, err_fd
        self.kernel_status = None
        self.seq = 0

    def reap(self, block_s=0.0):
        """Reaps finished children (the kernel, and orphans when this is PID 1); True once the kernel
        has ended. Waits up to `block_s` seconds for the kernel."""
        deadline = time.monotonic() + block_s
        while True:
            for pid, status in reap_exited():
                if pid == self.kernel_pid:
                    self.kernel_status = status
            if self.kernel_status is not None or time.monotonic() >= deadline:
                return self.kernel_status is not None
            time.sleep(0.01)

    def exit_with_kernel(self):
        """Ends the relay with the kernel's exit status (the kernel has ended or is ending)."""
        if not self.reap(5.0):
            os.kill(self.kernel_pid, signal.SIGKILL)
            self.reap(5.0)
        status = self.kernel_status
        os._exit(137 if status is None else _kernel_exit_code(status))

    def kernel_lost_its_socket(self):
        status = self.kernel_status
        return status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == _NO_REQUEST_CHANNEL

    def run(self, request):
        """Runs one request through the kernel; returns the reply for the host."""
        import socket

        self.seq += 1
        start = time.monotonic()
        head, tail = int(request["head"]), int(request["tail"])
        payload = json.dumps(
            {
                "seq": self.seq,
                "code": request["code"],
                "timeout": request["timeout"],
                "head": head,
                "tail": tail,
            }
        ).encode()
        read_fd, write_fd = os.pipe()
        try:
            try:
                socket.send_fds(
                    self.sock,
                    [len(payload).to_bytes(8, "big")],
                    [write_fd, self.out_fd, self.err_fd],
                )
                self.sock.sendall(payload)
            except OSError:
                if self.reap(2.0) and not self.kernel_lost_its_socket():
                    self.exit_with_kernel()
                return self._crash(request, start, "the code closed the session's request channel")
            finally:
                os.close(write_fd)
            data, flooded = self._read_result(read_fd, 32 * (head + tail) + (1 << 16))
        finally:
            os.close(read_fd)
        if flooded:
            return self._crash(request, start, "the code flooded the session's result channel")
        if not data:
            if self.reap(2.0):
                if self.kernel_lost_its_socket():
                    return self._crash(request, start, "the code closed the session's request channel")
                self.exit_with_kernel()
            return self._crash(request, start, "the code closed the session's result channel")
        lines = data.split(b"\n")
        result = self._parse(lines[0]) if len(lines) == 2 and not lines[1] else None
        if result is None:
            if len(lines) > 2 and self._parse(lines[0]) is not None:
                why = "the code wrote a result of its own into the session's result channel"
            else:
                why = "the code wrote into the session's result channel (its result was unreadable)"
            return self._crash(request, start, why)
        if "tampered" in result:
            return self._crash(
                request,
                start,
                "an earlier cell tampered with the session: " + result["tampered"],
            )
        reply = self._output(request, start)
        reply.update(value=result["value"], error=result["error"], timed_out=result["timed_out"])
        return reply

    @staticmethod
    def _read_result(fd, limit):
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks), False
            size += len(chunk)
            if size > limit:
                return b"", True
            chunks.append(chunk)

    def _parse(self, line):
        """The kernel's result line as a dict, or None unless it is exactly this request's result."""
        try:
            result = json.loads(line)
        except ValueError:
            return None
        allowed = set(_RESULT_KEYS) | {"tampered"}
        if not isinstance(result, dict) or not set(_RESULT_KEYS) <= set(result) <= allowed:
            return None
        if any(not isinstance(result[key], kind) for key, kind in _RESULT_KEYS.items()):
            return None
        if result["seq"] != self.seq or not isinstance(result.get("tampered", ""), str):
            return None
        return result

    def _output(self, request, start):
        head, tail = int(request["head"]), int(request["tail"])
        out_head, out_tail, out_size = _collect(self.out_fd, head, tail)
        err_head, err_tail, err_size = _collect(self.err_fd, head, tail)
        return {
            "id": request["id"],
            "stdout": [out_head, out_tail, out_size],
            "stderr": [err_head, err_tail, err_size],
            "value": None,
            "error": None,
            "timed_out": False,
            "elapsed": time.monotonic() - start,
        }

    def _crash(self, request, start, why):
        reply = self._output(request, start)
        reply["crash"] = why + "; the session was ended"
        return reply


def session(limits):
    import socket

    apply_limits(limits)
    out_fd, err_fd = (
        os.memfd_create("stdout", os.MFD_CLOEXEC),
        os.memfd_create("stderr", os.MFD_CLOEXEC),
    )
    relay_sock, kernel_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    pid = os.fork()
    if pid == 0:
        try:
            relay_sock.close()
            _kernel(kernel_sock, encoding, errors)
        finally:
            os._exit(70)
    kernel_sock.close()
    # Before the first request (so before any user code runs): nothing of this process is reachable.
    make_undumpable()
    relay_sock.shutdown(socket.SHUT_RD)  # the kernel can receive on the socket, never send
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    relay = _Relay(relay_sock, pid, out_fd, err_fd)
    requests = os.fdopen(0, "rb")
    replies = os.fdopen(1, "wb")
    while True:
        line = requests.readline()
        if not line:
            os.kill(pid, signal.SIGKILL)
            relay.reap(5.0)
            return
        reply = relay.run(json.loads(line))
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()
        if "crash" in reply:
            os.kill(pid, signal.SIGKILL)
            relay.reap(5.0)
            return
        relay.reap()


def _drop_to(uid, limits):
    """In the run's child, before exec: the limits, then no groups and RUN_UID as every uid and gid."""
    apply_limits(limits)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _kill_all_as(uid):
    """SIGKILLs every process the run uid can signal, in one kill(-1) (atomic against forks).

    Only the effective uid changes: the real and saved uids stay 0, so processes of the run uid can
    neither signal nor trace this process meanwhile."""
    os.seteuid(uid)
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.seteuid(0)


def _refuse(why):
    sys.stderr.write("[sandbox] one-shot wrapper: %s; nothing was run\n" % why)
    sys.stderr.flush()
    sys.exit(2)


def _read_code(announced, cap):
    """The code the host sent on stdin: all of it, up to EOF, before anything runs. Refuses (see
    `_refuse`) more than `cap` bytes, or another size than `announced`. Then stdin becomes /dev/null, so
    nothing started later holds the stream that carried the code."""
    if not 0 <= announced <= cap:
        _refuse("%d bytes announced, more than the cap of %d bytes" % (announced, cap))
    chunks, size = [], 0
    while True:
        try:
            chunk = os.read(0, min(1 << 20, cap + 1 - size))
        except InterruptedError:
            continue
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            _refuse("the code on stdin is more than %d bytes (the cap)" % cap)
    if size != announced:
        _refuse("got %d bytes where %d were announced" % (size, announced))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return b"".join(chunks)


def oneshot(run_uid, limits, timeout, code):
    """Runs `code` (bytes) as RUN_UID; see the module docstring."""
    import subprocess

    # close_fds (the default) and stdin=PIPE: the child gets none of this process's descriptors but
    # fds 1 and 2, and a fresh pipe as stdin.
    child = subprocess.Popen(
        [sys.executable, "-I", "-"], stdin=subprocess.PIPE, preexec_fn=lambda: _drop_to(run_uid, limits)
    )
    try:
        child.stdin.write(code)
        child.stdin.close()
    except BrokenPipeError:
        pass
    try:
        code = child.wait(timeout)
    except subprocess.TimeoutExpired:
        code = -signal.SIGKILL
    # Everything the run started (children, daemons) dies now; the host's clean then checks it.
    _kill_all_as(run_uid)
    sys.exit(128 - code if code < 0 else code)


WRITABLE_DIRS = ("/tmp", "/dev/shm", "/dev/mqueue")
_IPC_RMID = 0


def _other_processes():
    """Pids in this container other than PID 1 and this process (zombies included)."""
    me = os.getpid()
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me))


def _wipe(top, deadline):
    """Removes everything under directory `top` (not `top` itself); returns the number of entries removed.

    Runs with the run uid as effective uid, which owns every entry: a directory is first made 0700 (so
    chmod 000 / 500 trees open), its subdirectories are moved up to `top` (so depth costs neither
    recursion, nor open descriptors, nor path length), its other entries are unlinked, then it is removed."""
    from stat import S_ISDIR

    removed = 0
    top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        names = set(os.listdir(top_fd))
        queue = sorted(names)
        serial = 0
        while queue:
            if time.monotonic() > deadline:
                raise TimeoutError("%s: %d entries still to remove at the deadline" % (top, len(queue)))
            name = queue.pop()
            st = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
            if not S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=top_fd)
                names.discard(name)
                removed += 1
                continue
            os.chmod(name, 0o700, dir_fd=top_fd)
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top_fd)
            try:
                for entry in os.listdir(fd):
                    if time.monotonic() > deadline:
                        raise TimeoutError("%s: entries still to remove at the deadline" % top)
                    if S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                        os.chmod(entry, 0o700, dir_fd=fd)  # moving a directory rewrites its ".."
                        while ".clean-%d" % serial in names:
                            serial += 1
                        hoisted = ".clean-%d" % serial
                        os.rename(entry, hoisted, src_dir_fd=fd, dst_dir_fd=top_fd)
                        names.add(hoisted)
                        queue.append(hoisted)
                    else:
                        os.unlink(entry, dir_fd=fd)
                        removed += 1
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=top_fd)
            names.discard(name)
            removed += 1
    finally:
        os.close(top_fd)
    return removed


def _sysv_ids(kind):
    """Ids of the SysV IPC objects of `kind` ("shm", "sem", "msg") in this IPC namespace."""
    with open("/proc/sysvipc/" + kind) as f:
        lines = f.read().splitlines()[1:]
    return [int(line.split()[1]) for line in lines if line.strip()]


def _remove_sysv():
    """Marks every SysV shm segment, semaphore set and message queue for removal; returns their count."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    removers = {
        "shm": lambda i: libc.shmctl(i, _IPC_RMID, None),
        "sem": lambda i: libc.semctl(i, 0, _IPC_RMID),
        "msg": lambda i: libc.msgctl(i, _IPC_RMID, None),
    }
    count = 0
    for kind, remove in removers.items():
        for ipc_id in _sysv_ids(kind):
            if remove(ipc_id) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, "%s %d: %s" % (kind, ipc_id, os.strerror(errno)))
            count += 1
    return count


def clean(run_uid, deadline_s):
    deadline = time.monotonic() + deadline_s
    problems = []
    removed = {}
    os.setegid(run_uid)
    # Processes: SIGKILL everything until only PID 1 (which reaps the dead) and this process are left.
    while True:
        _kill_all_as(run_uid)
        left = _other_processes()
        if not left:
            break
        if time.monotonic() > deadline:
            problems.append("processes still running at the deadline: %s" % left)
            break
        time.sleep(0.01)
    os.seteuid(run_uid)  # every entry and IPC object below belongs to the run uid
    if not problems:
        for top in WRITABLE_DIRS:
            if not os.path.isdir(top):
                continue
            try:
                removed[top] = _wipe(top, deadline)
            except Exception as e:  # noqa: BLE001 - reported; the verification below decides
                problems.append("%s: %r" % (top, e))
        try:
            removed["sysv_ipc"] = _remove_sysv()
        except Exception as e:  # noqa: BLE001 - reported; the verification below decides
            problems.append("SysV IPC: %r" % (e,))
    # Verify from scratch: nothing may remain, whatever the steps above believed.
    for top in WRITABLE_DIRS:
        if os.path.isdir(top):
            left = os.listdir(top)
            if left:
                problems.append("%s still holds %d entries, e.g. %r" % (top, len(left), sorted(left)[:5]))
            if top != "/dev/mqueue":
                st = os.statvfs(top)
                if st.f_blocks != st.f_bfree:
                    problems.append("%s still uses %d blocks" % (top, st.f_blocks - st.f_bfree))
    for kind in ("shm", "sem", "msg"):
        left = _sysv_ids(kind)
        if left:
            problems.append("SysV %s still holds ids %s" % (kind, left[:5]))
    left = _other_processes()
    if left:
        problems.append("processes still present: %s" % left)
    sys.stdout.write(json.dumps({"ok": not problems, "problems": problems, "removed": removed}) + "\n")
    sys.stdout.flush()
    sys.exit(0 if not problems else 1)


def keeper(uid):
    import threading

    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)

    def watch_stdin():
        while True:
            try:
                if not os.read(0, 4096):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os._exit(0)

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    # SIGCHLD is blocked (in the watcher thread too) and taken synchronously: orphans are reaped at once.
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    threading.Thread(target=watch_stdin, daemon=True).start()
    while True:
        signal.sigtimedwait([signal.SIGCHLD], 1.0)
        for _ in reap_exited():
            pass


def main(argv):
    mode = argv[0]
    if mode == "session":
        session(json.loads(argv[1]))
    elif mode == "oneshot":
        if len(argv) != 6:
            sys.exit(
                "oneshot takes RUN_UID LIMITS_JSON TIMEOUT CODE_BYTES MAX_CODE_BYTES (the code comes on "
                "stdin); got %d arguments" % (len(argv) - 1)
            )
        code = _read_code(int(argv[4]), int(argv[5]))
        oneshot(int(argv[1]), json.loads(argv[2]), float(argv[3]), code)
    elif mode == "clean":
        clean(int(argv[1]), float(argv[2]))
    elif mode == "keeper":
        keeper(int(argv[1]))
    else:
        sys.exit("unknown mode %r; expected session, oneshot, clean or keeper" % mode)


if __name__ == "__main__":
    main(sys.argv[1:])

"""The program that runs INSIDE a sandbox (bubblewrap or a container). Standard library only.

The host never imports this module: it reads its source and starts it as `python3 -I -c SOURCE MODE ...`
inside the sandbox. Modes:

  session LIMITS_JSON
      A persistent Python session (like a notebook kernel). Requests arrive one JSON object per line on
      stdin ({"code", "timeout", "head", "tail"}); one JSON reply per line goes to stdout. Variables and
      imports persist across requests. The user's fd 1/2 (print, os.write, child processes) go to
      memory files that are read, capped (head + tail bytes) and emptied after each request, so nothing the
      user prints can corrupt the protocol. A cell that runs past its timeout is interrupted with
      CellTimeout (state is kept); one that ignores the interrupt is killed by the host.

  oneshot RUN_UID LIMITS_JSON TIMEOUT CODE_CHUNK...
      Started as root (docker exec, capabilities SETUID/SETGID only). Runs the joined code chunks with
      `python3 -I -` in a child process that has dropped to RUN_UID (uid and gid) under the limits, so the
      code can neither trace nor signal this wrapper or PID 1; then kills every process of RUN_UID.
      Exits with the child's exit code (128 + signal number when it was killed by a signal).

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


def session(limits):
    apply_limits(limits)
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    out_fd, err_fd = os.memfd_create("stdout", 0), os.memfd_create("stderr", 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    real_stdout, real_stderr = sys.stdout, sys.stderr
    sys.stdin = open(os.devnull)
    signal.signal(signal.SIGALRM, _on_alarm)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    counter = 0
    while True:
        line = requests.readline()
        if not line:
            return
        request = json.loads(line)
        counter += 1
        start = time.monotonic()
        value, error, timed_out = _run_cell(namespace, request["code"], request["timeout"], counter)
        for stream in (sys.stdout, sys.stderr, real_stdout, real_stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: B902 - the user may have closed or replaced the stream
                pass
        sys.stdout, sys.stderr = real_stdout, real_stderr
        head, tail = request["head"], request["tail"]
        out_head, out_tail, out_size = _collect(out_fd, head, tail)
        err_head, err_tail, err_size = _collect(err_fd, head, tail)
        if value is not None and len(value) > head + tail:
            value = (
                value[:head]
                + "\n... [%d characters of the value truncated] ...\n" % (len(value) - head - tail)
                + value[-tail:]
            )
        reply = {
            "stdout": [out_head, out_tail, out_size],
            "stderr": [err_head, err_tail, err_size],
            "value": value,
            "error": error,
            "timed_out": timed_out,
            "elapsed": time.monotonic() - start,
        }
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()


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


def oneshot(run_uid, limits, timeout, code):
    import subprocess

    child = subprocess.Popen(
        [sys.executable, "-I", "-"], stdin=subprocess.PIPE, preexec_fn=lambda: _drop_to(run_uid, limits)
    )
    try:
        child.stdin.write(code.encode("utf-8", "surrogatepass"))
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
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def main(argv):
    mode = argv[0]
    if mode == "session":
        session(json.loads(argv[1]))
    elif mode == "oneshot":
        oneshot(int(argv[1]), json.loads(argv[2]), float(argv[3]), "".join(argv[4:]))
    elif mode == "clean":
        clean(int(argv[1]), float(argv[2]))
    elif mode == "keeper":
        keeper(int(argv[1]))
    else:
        sys.exit("unknown mode %r; expected session, oneshot, clean or keeper" % mode)


if __name__ == "__main__":
    main(sys.argv[1:])

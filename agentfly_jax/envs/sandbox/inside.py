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

  oneshot LIMITS_JSON TIMEOUT CODE_CHUNK...
      Runs the joined code chunks with `python3 -I -` in a child process under the limits, then kills
      every other process of this uid and empties /tmp, so a pooled container is clean for the next run.
      Exits with the child's exit code (128 + signal number when it was killed by a signal).

  keeper
      PID 1 of a pooled container: reaps orphans and otherwise sleeps.
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


def oneshot(limits, timeout, code):
    import shutil
    import subprocess

    child = subprocess.Popen(
        [sys.executable, "-I", "-"], stdin=subprocess.PIPE, preexec_fn=lambda: apply_limits(limits)
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
    # Everything else this uid runs in the container (leftover children, daemons) dies now.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for name in os.listdir("/tmp"):
        path = os.path.join("/tmp", name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except OSError:
            pass
    sys.exit(128 - code if code < 0 else code)


def keeper():
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            time.sleep(0.5)


def main(argv):
    mode = argv[0]
    if mode == "session":
        session(json.loads(argv[1]))
    elif mode == "oneshot":
        oneshot(json.loads(argv[1]), float(argv[2]), "".join(argv[3:]))
    elif mode == "keeper":
        keeper()
    else:
        sys.exit("unknown mode %r; expected session, oneshot or keeper" % mode)


if __name__ == "__main__":
    main(sys.argv[1:])

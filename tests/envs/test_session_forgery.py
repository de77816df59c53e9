"""Cells that try to forge session replies, on both backends (see agentfly_jax/envs/sandbox/session.py).

A cell may write reply-shaped lines anywhere it can reach: they must come back as that cell's own output,
or, when it tampers with the session's result channel, end the session with a crash that says so. No
cell may ever receive another cell's reply, and no forged value may ever be taken as a later cell's.
"""

import json
import time

import pytest

from agentfly_jax.envs.sandbox import SandboxError, SandboxLimits
from agentfly_jax.envs.sandbox.session import PythonSession, Transport
from tests.envs.sandbox_helpers import cell

FORGED_REPLY = json.dumps(
    {
        "id": 2,
        "stdout": ["FORGED\n", "", 7],
        "stderr": ["", "", 0],
        "value": "'forged'",
        "error": None,
        "timed_out": False,
        "elapsed": 0.0,
    }
)
# What the kernel's runner itself writes to the result pipe of cell 1.
FORGED_RESULT = json.dumps({"seq": 1, "value": "'forged'", "error": None, "timed_out": False})


def later_cells_get_their_own_replies(loop, session):
    for n in (11, 22, 33):
        result = cell(loop, session, f"print('cell {n}')\n{n}")
        assert (result.stdout, result.value, result.error, result.restarted) == (
            f"cell {n}\n",
            str(n),
            None,
            False,
        )


def _each_fd(body: str) -> str:
    """Code that runs `body` (with `fd` bound) for every fd of the cell's process whose link starts with
    the given kind, e.g. 'pipe:' or 'socket:'."""
    return (
        "import os, json\n"
        "def _each(kind, action):\n"
        "    for fd in sorted(map(int, os.listdir('/proc/self/fd'))):\n"
        "        try:\n"
        "            link = os.readlink('/proc/self/fd/%d' % fd)\n"
        "        except OSError:\n"
        "            continue\n"
        "        if link.startswith(kind):\n"
        "            action(fd)\n" + body
    )


@pytest.mark.parametrize(
    "code",
    [
        f"import os\nos.write(1, {FORGED_REPLY!r}.encode() + b'\\n')\nNone",
        f"import sys\nsys.__stdout__.write({FORGED_REPLY!r} + '\\n')\nsys.__stdout__.flush()",
        f"print({FORGED_REPLY!r})",
        f"import os\nfor _ in range(5000):\n    os.write(1, {FORGED_REPLY!r}.encode() + b'\\n')",
        f"import sys\nsys.stdout = sys.__stderr__\nprint({FORGED_REPLY!r})",
    ],
    ids=["os.write(1)", "sys.__stdout__", "print", "5000 lines", "stdout swapped to stderr"],
)
def test_reply_shaped_output_is_only_output(loop, session, code):
    result = cell(loop, session, code)
    assert not result.restarted and result.crash is None and result.value is None
    assert FORGED_REPLY in result.stdout + result.stderr and "'forged'" != result.value
    later_cells_get_their_own_replies(loop, session)


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.close(1)\nprint('into a closed fd 1')",
        "import os\nos.close(1)\nos.close(2)",
        "import sys\nsys.stdout.close()",
        "import sys\nsys.__stdout__.close()\nsys.__stderr__.close()",
        "import os\nos.dup2(os.open('/dev/null', os.O_WRONLY), 1)",
    ],
    ids=[
        "close fd 1",
        "close fd 1 and 2",
        "sys.stdout.close()",
        "sys.__stdout__.close()",
        "fd 1 to /dev/null",
    ],
)
def test_breaking_stdout_breaks_only_this_cell(loop, session, code):
    result = cell(loop, session, code)
    assert not result.restarted and session.alive
    later_cells_get_their_own_replies(loop, session)


def test_the_host_channel_is_out_of_reach(loop, session):
    # The process holding the host channel (the cell process's parent) is undumpable: its fds can be
    # neither listed nor opened through /proc, nor taken with pidfd_getfd, nor reached with ptrace.
    code = (
        "import ctypes, os\n"
        "relay = os.getppid() or 1\n"
        "for path in ('/proc/%d/fd' % relay, '/proc/%d/fd/1' % relay, '/proc/%d/mem' % relay):\n"
        "    try:\n"
        "        os.close(os.open(path, os.O_WRONLY if path.endswith('/1') else os.O_RDONLY))\n"
        "        print('opened', path)\n"
        "    except PermissionError:\n"
        "        print('refused', path)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "pidfd = libc.syscall(434, relay, 0)  # pidfd_open\n"
        "got = libc.syscall(438, pidfd, 1, 0)  # pidfd_getfd: the relay's fd 1, the host channel\n"
        "if got >= 0:\n"
        f"    os.write(got, {FORGED_REPLY!r}.encode() + b'\\n')\n"
        "print('pidfd_getfd', got, ctypes.get_errno())\n"
        "attached = libc.ptrace(16, relay, 0, 0)  # PTRACE_ATTACH\n"
        "print('ptrace', attached, ctypes.get_errno())\n"
        "if attached == 0:\n"
        "    libc.ptrace(17, relay, 0, 0)  # PTRACE_DETACH\n"
    )
    result = cell(loop, session, code)
    assert result.error is None, result.error
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["refused"] * 3, result.stdout
    assert lines[3:] == ["pidfd_getfd -1 1", "ptrace -1 1"], result.stdout  # EPERM
    later_cells_get_their_own_replies(loop, session)


def test_every_file_object_the_cell_can_find_is_its_own_output(loop, session):
    code = (
        "import gc, io, os\n"
        "n = 0\n"
        "for obj in gc.get_objects():\n"
        "    if isinstance(obj, (io.BufferedWriter, io.TextIOWrapper, io.FileIO)) and not obj.closed:\n"
        "        try:\n"
        f"            line = {FORGED_REPLY!r} + '\\n'\n"
        "            obj.write(line if isinstance(obj, io.TextIOWrapper) else line.encode())\n"
        "            obj.flush()\n"
        "            n += 1\n"
        "        except Exception:\n"
        "            pass\n"
        "n"
    )
    result = cell(loop, session, code)
    assert not result.restarted and int(result.value) >= 1 and FORGED_REPLY in result.stdout + result.stderr
    later_cells_get_their_own_replies(loop, session)


def test_the_request_socket_refuses_to_send(loop, session):
    code = _each_fd(
        "import socket\n"
        "def send(fd):\n"
        "    s = socket.socket(fileno=os.dup(fd))\n"
        "    try:\n"
        f"        s.send({FORGED_REPLY!r}.encode() + b'\\n')\n"
        "        print('sent')\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
        "_each('socket:', send)\n"
    )
    result = cell(loop, session, code)
    assert result.stdout == "refused 32\n"  # EPIPE: the relay shut the socket down for its reading side
    later_cells_get_their_own_replies(loop, session)


# The flood is 2.6 MB, far more than a result of cells capped at 4 KiB of output can take.
@pytest.mark.parametrize(
    "body, crash",
    [
        (
            f"_each('pipe:', lambda fd: os.write(fd, {FORGED_RESULT!r}.encode() + b'\\n'))",
            "a result of its own",
        ),
        ("_each('pipe:', lambda fd: os.write(fd, b'{\"seq\": 1}\\n'))", "unreadable"),
        (f"_each('pipe:', lambda fd: os.write(fd, {FORGED_RESULT!r}.encode()))", "unreadable"),
        ("_each('pipe:', lambda fd: os.write(fd, b'x' * 65536 * 40))", "flooded"),
        ("_each('pipe:', os.close)", "closed the session's result channel"),
        ("_each('socket:', os.close)", "closed the session's request channel"),
    ],
    ids=["valid result", "partial result", "no newline", "flood", "close pipe", "close socket"],
)
def test_tampering_with_the_result_channel_ends_the_session(loop, session, body, crash):
    start = time.monotonic()
    if "socket" in body:
        first = cell(loop, session, _each_fd(body))  # the socket only matters for the next request
        assert not first.restarted
        result = cell(loop, session, "1")
    else:
        result = cell(loop, session, _each_fd(body), max_output_bytes=4096)
    assert time.monotonic() - start < 5.0
    assert result.restarted and crash in result.crash and "session was ended" in result.crash
    assert result.value is None and not session.alive
    with pytest.raises(SandboxError, match="session has ended"):
        cell(loop, session, "1")


def test_a_result_forged_before_closing_the_pipe_is_caught_on_the_next_cell(loop, session):
    def forge_and_close(fd):
        return f"os.write(fd, {FORGED_RESULT!r}.encode() + b'\\n'); os.close(fd)"

    code = _each_fd(f"def forge(fd):\n    {forge_and_close('fd')}\n_each('pipe:', forge)\n")
    first = cell(loop, session, code)  # answered by the cell itself, about itself
    assert first.value == "'forged'" and not first.restarted
    second = cell(loop, session, "print('next')\n2")
    assert second.restarted and "earlier cell tampered" in second.crash and second.value is None
    assert not session.alive


def test_killing_the_relay_ends_the_session_clearly(loop, session, backend):
    result = cell(
        loop, session, "import os, signal, time\nos.kill(os.getppid() or 1, signal.SIGKILL)\ntime.sleep(0.5)"
    )
    if backend == "bwrap":  # the relay is PID 1 of the sandbox: a signal from inside cannot reach it
        assert not result.restarted
        later_cells_get_their_own_replies(loop, session)
    else:
        assert result.restarted and "SIGKILL" in result.crash and not session.alive


def test_a_forked_child_does_not_hold_the_cell_open(loop, session):
    start = time.monotonic()
    result = cell(
        loop, session, "import os, time\nif os.fork() == 0:\n    time.sleep(4)\n    os._exit(0)\n'parent'"
    )
    assert result.value == "'parent'" and time.monotonic() - start < 2.0
    later_cells_get_their_own_replies(loop, session)


class _FakeTransport(Transport):
    """A fake session process (the real relay cannot answer out of turn): replies with canned lines."""

    def __init__(self, lines):
        self.lines = list(lines)
        self.terminated = False

    async def write(self, data):
        pass

    async def readline(self):
        return self.lines.pop(0) if self.lines else b""

    async def terminate(self):
        self.terminated = True

    def terminate_soon(self):
        self.terminated = True

    async def death_reason(self):
        return "gone"


@pytest.mark.parametrize(
    "reply, why",
    [
        ({"id": 2}, "answered request 2 when request 1 was due"),
        ({"id": "1"}, "field 'id'"),
        ({"stdout": ["a", "b"]}, "'stdout' is not [head, tail, size]"),
        ({"value": 3}, "field 'value'"),
        ({"crash": 1}, "'crash' is not text"),
    ],
)
def test_host_refuses_replies_that_do_not_answer_the_request(loop, reply, why):
    good = {
        "id": 1,
        "stdout": ["", "", 0],
        "stderr": ["", "", 0],
        "value": None,
        "error": None,
        "timed_out": False,
    }
    transport = _FakeTransport([json.dumps({**good, **reply}).encode() + b"\n"])
    session = PythonSession(transport, SandboxLimits())
    result = loop.run_until_complete(session.run_cell("1"))
    assert result.restarted and why in result.crash and transport.terminated and not session.alive
    ok = PythonSession(_FakeTransport([json.dumps(good).encode() + b"\n"]), SandboxLimits())
    assert not loop.run_until_complete(ok.run_cell("1")).restarted

"""Persistent sessions on both backends: state, interrupts, hard kills, crashes, capped output."""

import time

import pytest

from agentfly_jax.envs.sandbox import SandboxError
from tests.envs.sandbox_helpers import cell


def test_state_output_values_and_errors(loop, session):
    assert cell(loop, session, "import math\nradius = 2").value is None
    result = cell(
        loop, session, "print('area'); import sys; print('warn', file=sys.stderr)\nmath.pi * radius ** 2"
    )
    assert (
        result.stdout == "area\n"
        and result.stderr == "warn\n"
        and result.value == repr(3.141592653589793 * 4)
    )
    result = cell(loop, session, "def f(x):\n    return 1 / x\nf(0)")
    assert result.error.startswith("Traceback") and "ZeroDivisionError" in result.error
    assert "return 1 / x" in result.error  # tracebacks show the cell's own lines
    assert "inside.py" not in result.error  # and not the session runner's frames
    assert "SyntaxError" in cell(loop, session, "def (").error
    assert "SystemExit" in cell(loop, session, "raise SystemExit(2)").error
    assert cell(loop, session, "radius + 1").value == "3"  # still alive, state kept
    import_child = (
        "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'print(\"from a child\")'])\nNone"
    )
    assert cell(loop, session, import_child).stdout == "from a child\n"


def test_timeout_interrupts_and_keeps_state(loop, session):
    cell(loop, session, "counter = 0")
    start = time.monotonic()
    result = cell(loop, session, "while True:\n    counter += 1", timeout=1.0)
    assert time.monotonic() - start < 1.0 + 2.0
    assert result.timed_out and not result.restarted and session.alive
    assert int(cell(loop, session, "counter").value) > 0


def test_code_ignoring_the_interrupt_kills_the_session(loop, session):
    cell(loop, session, "kept = 1")
    start = time.monotonic()
    result = cell(loop, session, "sum(range(10**12))", timeout=1.0)  # C loop: never sees the interrupt
    assert time.monotonic() - start < 1.0 + session.grace_s + 2.0
    assert result.timed_out and result.restarted and "killed" in result.crash
    assert not session.alive
    with pytest.raises(SandboxError, match="session has ended"):
        cell(loop, session, "kept")


def test_interpreter_crash_is_reported(loop, session):
    result = cell(loop, session, "import os\nos._exit(3)")
    assert result.restarted and "exited with status 3" in result.crash
    assert not session.alive


def test_memory_error_keeps_the_session(loop, session):
    result = cell(loop, session, "x = bytearray(8 * 2**30)")
    assert "MemoryError" in result.error and session.alive
    assert cell(loop, session, "1 + 1").value == "2"


def test_output_is_capped_head_and_tail(loop, session):
    result = cell(loop, session, "for i in range(1_000_000):\n    print(i)", max_output_bytes=4096)
    assert result.stdout.startswith("0\n1\n") and result.stdout.endswith("999999\n")
    assert "bytes of output truncated" in result.stdout and len(result.stdout) < 5000
    huge_value = cell(loop, session, "'y' * 100_000", max_output_bytes=4096).value
    assert len(huge_value) < 5000 and "characters of the value truncated" in huge_value
    assert cell(loop, session, "print('next')").stdout == "next\n"  # buffers were emptied


def test_writing_into_the_control_channel_ends_only_this_session(loop, session):
    code = (
        "import os\n"
        "for fd in range(3, 12):\n"
        "    try:\n"
        "        os.write(fd, b'not json\\n')\n"
        "    except OSError:\n"
        "        pass"
    )
    result = cell(loop, session, code)
    assert result.restarted and "unreadable" in result.crash

"""The program a sandbox runs stays out of reach of the code it runs, on both backends (real bwrap, real
dockerd): no process the code can see carries it in its command line or environment, no file holds it, and
the stdin the code gets is empty.

Why it matters: the code-reward judge is such a program (the tests and the report token are in it) and the
solution it calls runs beside it (environments/code_interpreter/judge.py).
"""

import asyncio
import json
import secrets

import pytest

from agentfly_jax.envs.sandbox import run_python
from agentfly_jax.envs.sandbox.common import INSIDE_SOURCE, CappedBuffer
from agentfly_jax.envs.sandbox.docker_backend import MAX_CODE_BYTES, ROOT_USER, RUN_UID
from tests.envs.sandbox_helpers import require_backend

# Reads every /proc/*/cmdline and /proc/*/environ (and those of every thread) it may read and every file
# under /tmp and /dev/shm, looking for MARKER, which only its own program text holds. As a control, it
# starts a child of its own uid with a second marker in its argv and a third in its environment: the scan
# must find those, so a scan that reads nothing cannot pass.
SCANNER = r"""
import json, os, subprocess, sys, time
MARKER = "%(marker)s"
%(padding)s
ARGV_MARK = "argv-" + MARKER[::-1]
ENV_MARK = "env-" + MARKER[::-1]
control = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(30)", ARGV_MARK],
    env={"CONTROL": ENV_MARK}, stdin=subprocess.DEVNULL,
)
time.sleep(0.3)
hits, read, refused = [], 0, 0
me = os.getpid()
for pid in sorted(p for p in os.listdir("/proc") if p.isdigit()):
    places = ["/proc/%%s" %% pid]
    try:
        places += ["/proc/%%s/task/%%s" %% (pid, t) for t in os.listdir("/proc/%%s/task" %% pid)]
    except OSError:
        pass
    for place in places:
        for what in ("cmdline", "environ"):
            try:
                with open("%%s/%%s" %% (place, what), "rb") as f:
                    data = f.read()
            except OSError:
                refused += 1
                continue
            read += 1
            for mark in (MARKER, ARGV_MARK, ENV_MARK):
                if mark.encode() in data:
                    hits.append([int(pid), what, "own" if int(pid) == me else "other", mark[:4]])
files = 0
for top in ("/tmp", "/dev/shm"):
    for root, dirs, names in os.walk(top):
        for name in names:
            try:
                with open(os.path.join(root, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            files += 1
            if MARKER.encode() in data:
                hits.append([os.path.join(root, name), "file", "other", "MARK"])
control.kill()
control.wait()
print(json.dumps({
    "hits": sorted(set(map(tuple, hits))), "read": read, "refused": refused, "files": files,
    "ppid": os.getppid(), "stdin": sys.stdin.read(), "stdin_raw": os.read(0, 100).decode(),
}))
"""


def scanner(marker: str, padding_bytes: int) -> str:
    # A long comment makes the program larger than one argv string may be (it used to travel in chunks).
    padding = "# " + "p" * padding_bytes
    return SCANNER % {"marker": marker, "padding": padding}


@pytest.mark.parametrize("padding_bytes", [0, 300_000])
def test_no_process_or_file_the_code_can_read_holds_its_program(loop, backend, padding_bytes):
    marker = "SECRET-" + secrets.token_hex(16)
    result = loop.run_until_complete(
        run_python(scanner(marker, padding_bytes), backend=backend, timeout=30.0)
    )
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    found = {(mark, what) for _pid, what, _who, mark in report["hits"]}
    # The control: the scan reads other processes' cmdline and environ where it may.
    assert ("argv", "cmdline") in found and ("env-", "environ") in found, report
    program_hits = [hit for hit in report["hits"] if hit[3] == "SECR"]
    assert program_hits == [], f"the program's marker is readable in {program_hits}"
    assert report["read"] >= 4 and report["stdin"] == "" and report["stdin_raw"] == ""


@pytest.mark.docker
def test_docker_wrapper_cmdline_is_readable_but_carries_no_code(loop):
    """Under docker the code's parent is the root wrapper: its cmdline is world-readable (so it must not
    hold the code), its environ, fds and memory are not."""
    require_backend(loop, "docker")
    marker = "SECRET-" + secrets.token_hex(16)
    code = (
        "import json, os\nMARKER = %r\nparent = os.getppid()\n"
        "out = {'uid': os.stat('/proc/%%d' %% parent).st_uid}\n"
        "with open('/proc/%%d/cmdline' %% parent, 'rb') as f:\n"
        "    cmdline = f.read()\n"
        "out['cmdline_has_oneshot'] = b'oneshot' in cmdline\n"
        "out['cmdline_has_marker'] = MARKER.encode() in cmdline\n"
        "for what in ('environ', 'fd/0', 'mem'):\n"
        "    try:\n"
        "        open('/proc/%%d/%%s' %% (parent, what), 'rb').read(1)\n"
        "        out[what] = 'read'\n"
        "    except OSError as e:\n"
        "        out[what] = e.strerror\n"
        "print(json.dumps(out))\n" % marker
    )
    result = loop.run_until_complete(run_python(code, backend="docker", timeout=30.0))
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["uid"] == 0 and report["cmdline_has_oneshot"] is True, report
    assert report["cmdline_has_marker"] is False, report
    assert {report["environ"], report["fd/0"], report["mem"]} <= {
        "Permission denied",
        "Operation not permitted",
    }


@pytest.mark.docker
def test_docker_code_at_the_size_cap_runs_and_larger_code_is_refused(loop):
    sandbox = require_backend(loop, "docker")
    head = "import hashlib, sys\nprint(len(open('/proc/self/cmdline','rb').read()))\n#"
    tail = "\n"
    # Multi-byte characters: the cap counts bytes, not characters.
    body = "é" * ((MAX_CODE_BYTES - len(head) - len(tail)) // 2)
    code = head + body + "x" * (MAX_CODE_BYTES - len((head + body + tail).encode())) + tail
    assert len(code.encode()) == MAX_CODE_BYTES
    result = loop.run_until_complete(sandbox.run(code, timeout=30.0))
    assert result.exit_code == 0, result.stderr[-2000:]
    assert int(result.stdout) < 100  # `python3 -I -`: the code is not in its own argv either
    with pytest.raises(ValueError, match="larger than 1 MiB"):
        loop.run_until_complete(sandbox.run(code + "#", timeout=30.0))


def _wrapper_run(loop, sandbox, announced: int, data: bytes, cap: int) -> tuple[int, str]:
    """Starts the in-container one-shot wrapper by hand with `announced` / `cap` and sends it `data`."""

    async def go():
        command = [
            "python3", "-I", "-c", INSIDE_SOURCE, "oneshot", str(RUN_UID),
            sandbox.limits.rlimits_json(nproc=False, cpu_seconds=10), "10", str(announced), str(cap),
        ]  # fmt: skip
        out, err = CappedBuffer(1 << 16), CappedBuffer(1 << 16)
        async with sandbox._acquire() as container:
            container.runs += 1
            exec_id, stream = await sandbox._exec(container, command, stdin=True, user=ROOT_USER)
            try:
                await stream.write(data)
                stream.close_stdin()
                await asyncio.wait_for(sandbox._pump(stream, out, err), 20)
            finally:
                stream.close()
            return await sandbox._exit_code(exec_id), out.text() + err.text()

    return loop.run_until_complete(go())


@pytest.mark.docker
def test_docker_wrapper_refuses_code_over_its_cap_or_unlike_what_was_announced(loop):
    sandbox = require_backend(loop, "docker")
    ok = b"print('ran')\n"
    assert _wrapper_run(loop, sandbox, len(ok), ok, 100) == (0, "ran\n")
    code, text = _wrapper_run(loop, sandbox, len(ok), ok + b"#" * 200, 100)
    assert code == 2 and "more than 100 bytes" in text and "ran" not in text, (code, text)
    code, text = _wrapper_run(loop, sandbox, 200, b"#" * 200, 100)
    assert code == 2 and "200 bytes announced" in text and "100" in text, (code, text)
    code, text = _wrapper_run(loop, sandbox, len(ok) + 5, ok, 100)
    assert code == 2 and "got %d bytes where %d were announced" % (len(ok), len(ok) + 5) in text, text
    code, text = _wrapper_run(loop, sandbox, len(ok), ok + b"print('extra')\n", 100)
    assert code == 2 and "were announced" in text and "ran" not in text, (code, text)

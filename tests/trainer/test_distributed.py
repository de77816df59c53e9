"""Multi-process start-up (agentfly_jax/trainer/distributed.py): config.distributed's validation, the config and
code digests, the one-line description of what differs, cluster detection, and real two-process runs on this CPU
(jax.distributed with gloo collectives): processes that agree start and run a collective; processes started with
another config or other code both stop with the same clear error."""
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from agentfly_jax.trainer import distributed as dist
from agentfly_jax.trainer.config import ConfigError, DistributedSection, TrainConfig, default_config
from experiments import quickstart

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER_VARS = ("OMPI_MCA_orte_hnp_uri", "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                "SLURM_LOCALID", "JAX_COORDINATOR_ADDRESS")


def _cfg(**changes):
    c = quickstart.get_config()
    for key, value in changes.items():
        section, _, name = key.rpartition("__")
        (getattr(c, section) if section else c)[name] = value
    return TrainConfig.build(c)


def _refused(**changes) -> str:
    with pytest.raises(ConfigError) as err:
        _cfg(**changes)
    return str(err.value)


# ================================================================================================ config
def test_distributed_section_defaults_and_command_line_placeholders():
    assert TrainConfig.build(quickstart.get_config()).distributed == DistributedSection()
    section = DistributedSection()
    assert (section.heartbeat_timeout, section.exchange_timeout) == (120, 3600)
    # JAX's own heartbeat (a fatal abort of every process) comes after the watchdog's verdict and the grace
    assert dist.jax_heartbeat_timeout(120) > 2 * 120 and dist.jax_heartbeat_timeout(4) > 2 * 4
    c = default_config()
    c.distributed.num_processes = 4  # a placeholder of type int: settable from --config.distributed.num_processes
    c.distributed.process_id = 3
    with pytest.raises(TypeError):
        c.distributed.num_processes = "four"
    cfg = _cfg(distributed__coordinator_address="10.0.0.2:8476", distributed__num_processes=4,
               distributed__process_id=3)
    assert (cfg.distributed.coordinator_address, cfg.distributed.num_processes, cfg.distributed.process_id) == \
        ("10.0.0.2:8476", 4, 3)
    assert _cfg(distributed__coordinator_address="[fd00::2]:1234").distributed.coordinator_address == "[fd00::2]:1234"


@pytest.mark.parametrize("changes, expected", [
    ({"distributed__num_processes": 0}, ("config.distributed.num_processes=0 is out of range; allowed: None "
                                         "(auto-detect) or >= 1")),
    ({"distributed__process_id": -1}, "config.distributed.process_id=-1 is out of range"),
    ({"distributed__coordinator_address": "10.0.0.2"}, ("config.distributed.coordinator_address='10.0.0.2' is "
                                                       "out of range; allowed: '' (auto-detect) or 'host:port'")),
    ({"distributed__coordinator_address": "10.0.0.2:0"}, "coordinator_address='10.0.0.2:0' is out of range"),
    ({"distributed__coordinator_address": ":8476"}, "coordinator_address=':8476' is out of range"),
    ({"distributed__coordinator_address": "host:http"}, "coordinator_address='host:http' is out of range"),
    ({"distributed__initialization_timeout": 0}, "config.distributed.initialization_timeout=0 is out of range"),
    ({"distributed__heartbeat_timeout": 0}, "config.distributed.heartbeat_timeout=0 is out of range; allowed: > 0"),
    ({"distributed__exchange_timeout": -1}, "config.distributed.exchange_timeout=-1 is out of range; allowed: > 0"),
    ({"distributed__num_processes": 2, "distributed__process_id": 2},
     "config.distributed.process_id=2 with num_processes=2: process ids run from 0 to num_processes - 1"),
    ({"distributed__num_processes": 1, "distributed__process_id": 1},
     "config.distributed.process_id=1 with num_processes=1: process ids run from 0 to num_processes - 1"),
])
def test_distributed_section_refuses_bad_values_in_one_line(changes, expected):
    message = _refused(**changes)
    assert expected in message and "\n" not in message


# ================================================================================================ digests
def test_config_digest_ignores_per_process_fields_only():
    base = dist.config_digest(_cfg())
    assert len(base) == 64 and base == dist.config_digest(_cfg())  # two builds of one config
    assert dist.config_digest(_cfg(distributed__num_processes=2, distributed__process_id=1,
                                   distributed__coordinator_address="h:1", distributed__initialization_timeout=9,
                                   distributed__heartbeat_timeout=7, distributed__exchange_timeout=60,
                                   progress=False)) == base
    for changes in ({"rl__steps": 7}, {"workdir": "runs/other"}, {"optimizer__learning_rate": 2e-6},
                    {"seq_buckets": (1024, 512)}, {"env__options": {"seed_offset": 1}}):
        assert dist.config_digest(_cfg(**changes)) != base, changes
    # the digest is sha256 of the canonical JSON of asdict() without the per-process sections
    import dataclasses
    import json
    values = dataclasses.asdict(_cfg())
    del values["distributed"], values["progress"]
    assert base == hashlib.sha256(json.dumps(values, sort_keys=True, separators=(",", ":"),
                                             default=str).encode()).hexdigest()


def test_config_values_name_leaves_by_dotted_path():
    options = dict(quickstart.get_config().env.options)
    a, b = dist.config_values(_cfg()), dist.config_values(_cfg(rl__steps=7, env__options={**options, "x": [1, 2]}))
    assert not any(k.startswith(("distributed", "progress")) for k in a)
    assert a["rl.steps"] != b["rl.steps"] and b["rl.steps"] == "7" and b["env.options.x"] == "[1,2]"
    assert sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)) == ["env.options.x", "rl.steps"]


def test_code_digest_covers_python_files_by_path_and_content(tmp_path):
    pkg = tmp_path / "agentfly_jax"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__pycache__").mkdir()
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "sub" / "mod.py").write_text("y = 2\n")
    (pkg / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0compiled")
    (pkg / "notes.txt").write_text("not code")
    files = dist.code_files(str(pkg))
    assert files == {"agentfly_jax/__init__.py": hashlib.sha256(b"x = 1\n").hexdigest(),
                     "agentfly_jax/sub/mod.py": hashlib.sha256(b"y = 2\n").hexdigest()}
    digest = dist.code_digest(str(pkg))
    (pkg / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0other")
    (pkg / "notes.txt").write_text("changed")
    assert dist.code_digest(str(pkg)) == digest
    (pkg / "sub" / "mod.py").write_text("y = 3\n")
    assert dist.code_digest(str(pkg)) != digest
    (pkg / "sub" / "mod.py").write_text("y = 2\n")
    assert dist.code_digest(str(pkg)) == digest
    (pkg / "sub" / "mod.py").rename(pkg / "sub" / "moved.py")  # same content, other path
    assert dist.code_digest(str(pkg)) != digest
    real = dist.code_files()
    assert "agentfly_jax/trainer/distributed.py" in real and dist.code_digest() == dist.code_digest(files=real)


# ============================================================================================= describing
def _digests(n, **per_process):
    out = [{"config": "c0", "code": "k0", "versions": {"python": "3.11", "jax": "0.10.2", "jaxlib": "0.10.2"}}
           for _ in range(n)]
    for key, value in per_process.items():
        kind, _, i = key.rpartition("_")
        out[int(i)] = {**out[int(i)], kind: value}
    return out


def test_describe_mismatch_names_what_differs_and_where():
    details = {i: {"config": {"rl.steps": "5", "seed": "0"}, "code": {"agentfly_jax/a.py": "h"}} for i in range(4)}
    asked = []

    def get(i):
        asked.append(i)
        return details[i]

    assert dist.describe_mismatch(_digests(4), get) is None and asked == []
    details[2] = {"config": {"rl.steps": "6", "seed": "0", "rl.extra": "1"}, "code": details[0]["code"]}
    message = dist.describe_mismatch(_digests(4, config_2="c2", config_3="c3"), get)
    assert message == ("the 4 processes of this run did not start the same: config digest differs: processes 2, 3 "
                       "started with another config than process 0 (rl.extra: (absent) on process 0, 1 on process 2, "
                       "rl.steps: 5 on process 0, 6 on process 2); start every process with the same experiment "
                       "file and --config overrides")
    assert set(asked) == {0, 2}
    details[1] = {"config": details[0]["config"], "code": {"agentfly_jax/a.py": "other", "agentfly_jax/b.py": "new"}}
    message = dist.describe_mismatch(_digests(4, code_1="k1"), get)
    assert "code digest differs: process 1 runs other agentfly_jax code than process 0 (files that differ between " \
           "process 0 and process 1: agentfly_jax/a.py, agentfly_jax/b.py); install the same commit" in message
    assert "config digest" not in message
    versions = {"python": "3.11", "jax": "0.10.1", "jaxlib": "0.10.2"}
    message = dist.describe_mismatch(_digests(3, versions_1=versions, code_2="k2", config_1="c1"), get)
    assert "config digest differs: process 1" in message and "code digest differs: process 2" in message
    assert "library versions differ on process 1 (jax 0.10.2 on process 0, 0.10.1 on process 1)" in message
    assert "\n" not in message


def test_describe_mismatch_shortens_long_lists():
    many = {f"k{i:02d}": str(i) for i in range(9)}
    details = {0: {"config": {}, "code": {}}, 1: {"config": many, "code": {}}}
    message = dist.describe_mismatch(_digests(9, **{f"config_{i}": "x" for i in range(1, 9)}), details.__getitem__)
    assert "processes 1, 2, 3, 4, 5 and 3 more started" in message
    assert "k04: (absent) on process 0, 4 on process 1, ...)" in message and "k05" not in message


# ========================================================================================== initialisation
def test_detect_cluster_from_launcher_variables():
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "0"}
    assert dist.detect_cluster(slurm) == dist.Cluster("slurm", 2)
    assert dist.detect_cluster({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2"}) is None  # a salloc shell, not srun
    assert dist.detect_cluster({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:4", "OMPI_COMM_WORLD_SIZE": "8",
                                **slurm}) == dist.Cluster("openmpi", 8)  # JAX's order: Open MPI first
    assert dist.detect_cluster({"PATH": "/usr/bin"}) is None


@pytest.fixture
def no_cluster(monkeypatch):
    import jax

    for var in CLUSTER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not jax.distributed.is_initialized()
    yield
    assert not jax.distributed.is_initialized()  # nothing here may leave this test process distributed


def test_one_process_starts_nothing(no_cluster):
    assert dist.detect_cluster() is None  # this machine is no cluster (and no TPU VM)
    assert dist.initialize(DistributedSection()) is False
    assert dist.initialize(DistributedSection(num_processes=1)) is False
    assert dist.start(_cfg()) is False and dist.start(_cfg()) is False


def test_partial_keys_without_a_cluster_are_refused(no_cluster):
    with pytest.raises(dist.DistributedError) as err:
        dist.initialize(DistributedSection(num_processes=2, process_id=1))
    assert str(err.value) == ("config.distributed sets num_processes, process_id but no cluster that JAX detects "
                              "(Cloud TPU slice, SLURM step, Open MPI job) supplies "
                              "config.distributed.coordinator_address: set coordinator_address, num_processes and "
                              "process_id on every process")


def test_unreachable_coordinator_is_one_line_not_an_abort(no_cluster):
    port = _free_port()
    t0 = time.perf_counter()
    with pytest.raises(dist.DistributedError) as err:
        dist.initialize(DistributedSection(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=1,
                                           initialization_timeout=1))
    assert time.perf_counter() - t0 < 5
    assert str(err.value).startswith(f"config.distributed.coordinator_address='127.0.0.1:{port}' accepted no "
                                      "connection within 1 s")


# ============================================================================ real processes on this CPU
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(pythonpath=ROOT):
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS and k != "XLA_FLAGS"}
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}


def _run_together(commands, timeout=60):
    """Starts every (argv, cwd, env) at once; their (returncode, stdout, stderr) after all ended (killed past
    `timeout` seconds: a hang fails the test instead of blocking it)."""
    procs = [subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv, cwd, env in commands]
    deadline, results = time.monotonic() + timeout, []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def _train_argv(port, pid, *overrides):
    return [sys.executable, "-m", "agentfly_jax.train", "--config", os.path.join(ROOT, "experiments/quickstart.py"),
            f"--config.distributed.coordinator_address=127.0.0.1:{port}", "--config.distributed.num_processes=2",
            f"--config.distributed.process_id={pid}", "--config.distributed.initialization_timeout=30", *overrides]


_AGREEING = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
import numpy as np
from experiments import quickstart
from agentfly_jax.trainer import distributed
from agentfly_jax.trainer.config import TrainConfig
port, pid, progress = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "True"
c = quickstart.get_config()
c.distributed.coordinator_address = f"127.0.0.1:{port}"
c.distributed.num_processes, c.distributed.process_id, c.distributed.initialization_timeout = 2, pid, 30
c.progress = progress  # a per-process field: left out of the digest
cfg = TrainConfig.build(c)
started = [distributed.start(cfg), distributed.start(cfg)]  # the second call is a no-op
import jax
from jax.experimental import multihost_utils
gathered = multihost_utils.process_allgather(np.array([10 + jax.process_index()]))
print(json.dumps({"started": started, "index": jax.process_index(), "count": jax.process_count(),
                  "gathered": np.asarray(gathered).ravel().tolist()}))
"""


def test_two_processes_with_one_config_start_and_run_a_collective():
    port = _free_port()
    t0 = time.perf_counter()
    results = _run_together([([sys.executable, "-c", _AGREEING, str(port), str(pid), str(pid == 0)], ROOT, _env())
                             for pid in (0, 1)])
    assert time.perf_counter() - t0 < 30
    import json
    for pid, (rc, out, err) in enumerate(results):
        assert rc == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got == {"started": [True, True], "index": pid, "count": 2, "gathered": [10, 11]}
        assert f"process {pid} of 2: config" in err and "the same on every process" in err


def test_another_config_stops_both_processes_with_the_same_error():
    port = _free_port()
    t0 = time.perf_counter()
    results = _run_together([(_train_argv(port, pid, f"--config.rl.steps={5 + pid}"), ROOT, _env()) for pid in (0, 1)])
    assert time.perf_counter() - t0 < 30  # both stop at start-up, before any model work
    for pid, (rc, out, err) in enumerate(results):
        assert rc == 2, err[-3000:]
        assert out == "" and "Traceback" not in err
        line = err.strip().splitlines()[-1]
        assert line == ("agentfly-train: the 2 processes of this run did not start the same: config digest differs: "
                        "process 1 started with another config than process 0 (rl.steps: 5 on process 0, 6 on "
                        "process 1); start every process with the same experiment file and --config overrides "
                        f"(this is process {pid})")


def test_other_code_stops_both_processes_with_the_same_error(tmp_path):
    # each process imports its own copy of the package (first on its path; its cwd is not the checkout): one
    # snapshot, copied again and edited for process 1, so nothing but that edit differs
    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(os.path.join(ROOT, "agentfly_jax"), same / "agentfly_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(same, other)
    with open(other / "agentfly_jax" / "trainer" / "batch.py", "a") as fh:
        fh.write("\n# an edit made on one host only\n")
    port = _free_port()
    results = _run_together([(_train_argv(port, pid), str(copy), _env(f"{copy}{os.pathsep}{ROOT}"))
                             for pid, copy in enumerate((same, other))])
    for pid, (rc, _, err) in enumerate(results):
        assert rc == 2, err[-3000:]
        line = err.strip().splitlines()[-1]
        assert line.startswith("agentfly-train: the 2 processes of this run did not start the same: code digest "
                               "differs: process 1 runs other agentfly_jax code than process 0 (files that differ "
                               "between process 0 and process 1: agentfly_jax/trainer/batch.py); install the same "
                               "commit on every host"), line
        assert "config digest" not in line and line.endswith(f"(this is process {pid})")


# ============================================================================ a process lost in a collective
_IN_A_COLLECTIVE = """
import logging, os, signal, subprocess, sys, time
logging.basicConfig(level=logging.INFO)
import numpy as np
from experiments import quickstart
from agentfly_jax.trainer import distributed
from agentfly_jax.trainer.config import TrainConfig
port, pid, fault, marker = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
c = quickstart.get_config()
c.distributed.coordinator_address = f"127.0.0.1:{port}"
c.distributed.num_processes, c.distributed.process_id, c.distributed.initialization_timeout = 2, pid, 30
c.distributed.heartbeat_timeout = 3
distributed.start(TrainConfig.build(c))
import jax
from jax.experimental import multihost_utils
multihost_utils.process_allgather(np.array([1]))  # compiled and run once by both
if pid == 0:  # a child process standing for an environment server, and a cleanup of the trainer's
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    print("server", server.pid, flush=True)
    distributed.at_emergency_exit(lambda: open(marker, "w").write("cleaned up"))
    time.sleep(0.5)
else:
    os.kill(os.getpid(), getattr(signal, fault))
try:  # process 0 is in the collective when process 1 is gone: it never returns (SIGSTOP) or breaks (SIGKILL)
    multihost_utils.process_allgather(np.array([2]))
except BaseException as e:  # what the trainer's loop does with an error that ends its run
    raise distributed.stopped_by(e) or e
print("the collective returned", flush=True)
"""


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_a_process_lost_during_a_collective_ends_the_other(tmp_path, fault):
    """Process 1 is frozen (SIGSTOP) or killed while process 0 enters a collective with it (gloo on this CPU, NCCL
    or ICI elsewhere). Killed: the collective breaks and process 0 waits for the watchdog's verdict to say why.
    Frozen: the collective never returns, so the watchdog ends process 0 heartbeat_timeout s after its verdict,
    after its cleanups and with its child processes. Either way within about 2 x heartbeat_timeout (3 s here)."""
    port, marker = _free_port(), tmp_path / "marker"
    env = _env()
    procs = [subprocess.Popen([sys.executable, "-c", _IN_A_COLLECTIVE, str(port), str(pid), fault, str(marker)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in (0, 1)]
    deadline, lost_at, ended_at = time.monotonic() + 60, None, None
    try:
        while ended_at is None and time.monotonic() < deadline:
            if lost_at is None and (procs[1].poll() is not None or _state(procs[1].pid) == "T"):
                lost_at = time.monotonic()
            if procs[0].poll() is not None:
                ended_at = time.monotonic()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        out, err = procs[0].communicate()
        procs[1].communicate()
    assert lost_at is not None and ended_at is not None, err[-3000:]
    assert ended_at - lost_at < 2 * 3 + 4, f"process 0 ended {ended_at - lost_at:.1f} s after process 1 was lost"
    server = int(out.split("server ")[1].split()[0])
    assert procs[0].returncode == 1, err[-3000:]
    assert "the collective returned" not in out
    lines = [line for line in err.splitlines() if "process 1 of 2 sent no heartbeat for" in line]
    assert lines and "--config.resume=True" in lines[-1], err[-3000:]
    if fault == "SIGSTOP":
        assert "still runs 3 s after it stopped for another process" in err
        assert marker.read_text() == "cleaned up"
    else:  # the broken collective raised: the trainer's ProcessLostError, no emergency exit
        assert err.strip().splitlines()[-1].startswith("agentfly_jax.trainer.distributed.ProcessLostError: process "
                                                       "1 of 2 sent no heartbeat"), err[-3000:]
        assert not marker.exists()
    deadline = time.monotonic() + 5
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(server), "process 0's child outlived it"


def _state(pid: int) -> str:
    """The state letter of process `pid` (R, S, T: stopped, Z: a zombie), '' once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0]
    except OSError:
        return ""


def _running(pid: int) -> bool:
    return _state(pid) not in ("", "Z")


_HUNG = """
import logging, signal, sys, time
# how the process was started: SIGINT Python's (a terminal, a foreground job), or ignored, as a process started in
# the background by a non-interactive shell (`cmd &`, CI runners) inherits it and Python then leaves it
signal.signal(signal.SIGINT, signal.SIG_IGN if sys.argv[3] == "ignored" else signal.default_int_handler)
logging.basicConfig(level=logging.INFO, format="%(relativeCreated)7.0f ms %(levelname)s %(name)s: %(message)s")
logging.getLogger("agentfly_jax").setLevel(logging.DEBUG)  # how process 0's wait for the other ended, if it fails
from experiments import quickstart
from agentfly_jax.trainer import distributed
from agentfly_jax.trainer.config import TrainConfig
port, pid = int(sys.argv[1]), int(sys.argv[2])
c = quickstart.get_config()
c.distributed.coordinator_address = f"127.0.0.1:{port}"
c.distributed.num_processes, c.distributed.process_id, c.distributed.initialization_timeout = 2, pid, 30
# heartbeat_timeout: the grace after which a process's own watchdog ends it, and so about how long process 0 waits
# for the other to end before its coordinator goes (JAX then aborts whoever is still connected)
c.distributed.heartbeat_timeout, c.distributed.exchange_timeout = 10, 2
try:
    # inside: under load process 0 may time out at the exchange and tell process 1 to stop while process 1 is still
    # on its way out of start (its watchdog runs from the end of start)
    distributed.start(TrainConfig.build(c))
    if pid == 1:
        time.sleep(60)  # hung in its own code (an environment that never answers), its heartbeats still going
    distributed.allgather_json({"rows": 3})
except BaseException as e:  # what the trainer's loop does with an error that ends its run
    raise distributed.stopped_by(e) or e
"""


@pytest.mark.parametrize("sigint", ["python", "ignored"])
def test_a_hung_process_is_named_at_the_exchange_and_told_to_stop(sigint):
    """Process 1 is alive (its heartbeats go on) but never reaches the exchange: process 0 names it after
    exchange_timeout (2 s) and tells it; process 1, interrupted in its own code (a sleep), stops with process 0's
    reason. Both exit with status 1 within seconds, not at process 1's 60 s. With SIGINT ignored the watchdog
    interrupts through SIGUSR1: without it process 1 slept until its grace ended it, and process 0, leaving about
    then, could make JAX abort it first (a suite run in the background failed so, 3 times)."""
    port = _free_port()
    t0 = time.perf_counter()
    results = _run_together([([sys.executable, "-c", _HUNG, str(port), str(pid), sigint], ROOT, _env())
                             for pid in (0, 1)], timeout=40)
    assert time.perf_counter() - t0 < 30
    (rc0, _, err0), (rc1, _, err1) = results
    both = f"process 0 ({rc0}):\n{err0[-3000:]}\nprocess 1 ({rc1}):\n{err1[-3000:]}"
    assert rc0 == 1 and rc1 == 1, both
    # each traceback's last line (debug lines of the processes' ends follow it here)
    error0, error1 = ([line for line in err.splitlines() if line.startswith("agentfly_jax.trainer.distributed.")]
                      or [""] for err in (err0, err1))
    error0, error1 = error0[-1], error1[-1]
    assert error0 and error1, both
    assert error0.startswith(
        "agentfly_jax.trainer.distributed.DistributedError: process 1 of 2 did not publish its share of exchange 1 "
        "within 2 s (config.distributed.exchange_timeout) although it still sends heartbeats: it hangs"), both
    assert error1.startswith(
        "agentfly_jax.trainer.distributed.ProcessLostError: process 0 of 2 failed: DistributedError: process 1 of 2 "
        "did not publish its share of exchange 1 within 2 s"), both
    assert "still runs" not in err1, both  # interrupted, not ended by its watchdog's grace

"""The multi-host launchers (scripts/tpu/*.sh, scripts/gpu/ssh.sh, scripts/gpu/srun.sh), run for real against FAKE
`gcloud`, `ssh`, `srun` and `scontrol` programs put first on PATH (no cloud or cluster here). Each fake records its
argv; the fake gcloud and ssh also run the remote command they are given in a local folder standing for the
worker's home (holding the worker-side scripts/multihost/), and a FAKE python records the trainer's argv there, so
the remote quoting and scripts/multihost/worker.sh are exercised too. Every --dry-run prints exactly the commands
the real run makes, and runs none."""
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The fakes: python scripts named like the real programs. FAKE_DIR holds calls.jsonl (one argv per call).
_FAKE_GCLOUD = """
import json, os, shutil, subprocess, sys
d = os.environ["FAKE_DIR"]
args = sys.argv[1:]
with open(os.path.join(d, "calls.jsonl"), "a") as fh:
    fh.write(json.dumps(["gcloud", *args]) + "\\n")
if args[:4] == ["compute", "tpus", "queued-resources", "describe"]:
    states = open(os.path.join(d, "states")).read().split()
    n = len(open(os.path.join(d, "calls.jsonl")).read().splitlines()) - 2  # calls before: create + earlier ones
    print(states[min(n, len(states) - 1)])
elif args[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
    shutil.copy(args[4], os.path.join(d, "copied.tar.gz"))
elif args[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and os.environ.get("FAKE_RUN_REMOTE") == "1":
    command = next(a.split("=", 1)[1] for a in args if a.startswith("--command="))
    sys.exit(subprocess.run(["bash", "-c", command], cwd=os.path.join(d, "home")).returncode)
"""
_FAKE_SSH = """
import json, os, subprocess, sys
d = os.environ["FAKE_DIR"]
with open(os.path.join(d, "calls.jsonl"), "a") as fh:
    fh.write(json.dumps(["ssh", *sys.argv[1:]]) + "\\n")
args = sys.argv[1:]
while args[0] == "-o":
    args = args[2:]
host, command = args[0], args[1]
home = os.path.join(d, "homes", host)
sys.exit(subprocess.run(["bash", "-c", command], cwd=home).returncode)
"""
_FAKE_SRUN = """
import json, os, subprocess, sys
d = os.environ["FAKE_DIR"]
with open(os.path.join(d, "calls.jsonl"), "a") as fh:
    fh.write(json.dumps(["srun", *sys.argv[1:]]) + "\\n")
args, nodes = sys.argv[1:], 1
while args[0].startswith("-"):
    if args[0].startswith("--nodes="):
        nodes = int(args[0].split("=")[1])
    args = args[1:]
for task in range(nodes):  # one task per node, as --ntasks-per-node=1 asks, run one after another
    env = {**os.environ, "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NTASKS": str(nodes), "SLURM_PROCID": str(task)}
    rc = subprocess.run(args, env=env).returncode
    if rc:
        sys.exit(rc)
"""
_FAKE_SCONTROL = """
import sys
assert sys.argv[1:] == ["show", "hostnames", "node-[a-b]"], sys.argv
sys.stdout.write("node-a\\nnode-b\\n")  # one write: the reader takes the first line and goes
"""
_FAKE_PYTHON = """
import json, os, sys, time
d = os.environ["FAKE_DIR"]
tag = os.environ.get("SLURM_PROCID") or os.path.basename(os.path.dirname(os.getcwd()))  # task id, or home folder
with open(os.path.join(d, f"trainer-{tag}.json"), "w") as fh:
    json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
               "extra": os.environ.get("FAKE_EXTRA"), "pgid": os.getpgid(0), "pid": os.getpid()}, fh)
print("trainer started", flush=True)
if os.environ.get("FAKE_TRAINER_SLEEPS") == "1":
    time.sleep(60)
"""


@pytest.fixture
def fakes(tmp_path):
    """FAKE_DIR with the fake programs in bin/, and a worker home (home/, homes/<host>/) holding the worker-side
    scripts as a checkout named agentfly-jax."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in (("gcloud", _FAKE_GCLOUD), ("ssh", _FAKE_SSH), ("srun", _FAKE_SRUN),
                       ("scontrol", _FAKE_SCONTROL), ("python", _FAKE_PYTHON)):
        path = bindir / name
        path.write_text(f"#!{sys.executable}\n# FAKE {name} for tests/scripts/test_launch_scripts.py\n{body}")
        path.chmod(0o755)
    for home in (tmp_path / "home", tmp_path / "homes" / "alice@gpu-a", tmp_path / "homes" / "gpu-b"):
        shutil.copytree(os.path.join(ROOT, "scripts", "multihost"), home / "agentfly-jax" / "scripts" / "multihost")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "SLURM_"))}
    env.update(PATH=f"{bindir}{os.pathsep}{env['PATH']}", FAKE_DIR=str(tmp_path), PYTHON=str(bindir / "python"))
    return tmp_path, env


def _run(script, *args, env, dry=False, **extra_env):
    if dry:  # before `--`: everything after it goes to the trainer
        cut = args.index("--") if "--" in args else len(args)
        args = (*args[:cut], "--dry-run", *args[cut:])
    return subprocess.run(["bash", os.path.join(ROOT, script), *args],
                          env={**env, **extra_env}, capture_output=True, text=True, timeout=60, check=False)


def _calls(d):
    path = d / "calls.jsonl"
    if not path.exists():
        return []
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    path.unlink()
    return calls


def _printed(stdout):
    """The commands a dry run printed (comment lines left out), as argv lists."""
    return [shlex.split(line) for line in stdout.splitlines() if line and not line.startswith("#")]


def _trainer(d, tag, wait=10.0):
    path = d / f"trainer-{tag}.json"
    deadline = time.monotonic() + wait
    while not path.exists():
        assert time.monotonic() < deadline, f"the trainer of {tag} never started"
        time.sleep(0.05)
    for _ in range(100):  # the fake writes it in one go; it may be seen mid-write
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            time.sleep(0.05)
    return json.loads(path.read_text())


def _gone(pid, wait=5.0) -> bool:
    """The process has ended (a zombie waiting for its reaper counts as ended) within `wait` seconds."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


TPU = ["--name", "pod1", "--zone", "us-east5-a", "--project", "proj"]
SCOPE = ["--zone=us-east5-a", "--project=proj"]
# awkward arguments: a space, quotes, a dollar sign and a glob must reach the trainer unchanged
TRAIN = ["--config", "experiments/quickstart.py", "--config.rl.steps=3",
         "--config.agent.system_prompt=It's a \"test\" of $HOME *"]


# ================================================================================================= TPU
def test_tpu_create_queues_the_slice_and_waits_until_active(fakes):
    d, env = fakes
    (d / "states").write_text("WAITING_FOR_RESOURCES PROVISIONING ACTIVE")
    proc = _run("scripts/tpu/create.sh", *TPU, "--accelerator", "v5p-32", "--spot", "--poll", "0", env=env)
    assert proc.returncode == 0, proc.stderr
    create = ["gcloud", "compute", "tpus", "queued-resources", "create", "pod1", "--node-id=pod1", *SCOPE,
              "--accelerator-type=v5p-32", "--runtime-version=v2-alpha-tpuv5", "--spot"]
    describe = ["gcloud", "compute", "tpus", "queued-resources", "describe", "pod1", *SCOPE,
                "--format=value(state.state)"]
    assert _calls(d) == [create, describe, describe, describe]
    assert "pod1 is ACTIVE" in proc.stderr
    dry = _run("scripts/tpu/create.sh", *TPU, "--accelerator", "v5p-32", "--spot", "--poll", "0", env=env, dry=True)
    assert dry.returncode == 0 and _calls(d) == [] and _printed(dry.stdout) == [create, describe]

    # v6e's runtime by default; a failed request stops the wait with the state named
    (d / "states").write_text("WAITING_FOR_RESOURCES FAILED")
    proc = _run("scripts/tpu/create.sh", "--name=pod2", "--zone=us-east5-b", "--accelerator=v6e-32", "--poll=0",
                env=env)
    assert proc.returncode == 2
    calls = _calls(d)
    assert calls[0][-2:] == ["--accelerator-type=v6e-32", "--runtime-version=v2-alpha-tpuv6e"] and len(calls) == 3
    assert "queued resource pod2 is FAILED" in proc.stderr.strip().splitlines()[-1]


def test_tpu_scripts_refuse_missing_or_unknown_options(fakes):
    d, env = fakes
    for args, message in ((["--zone", "z", "--accelerator", "v5p-8"], "--name is required"),
                          (["--name", "n", "--accelerator", "v5p-8"], "--zone is required"),
                          ([*TPU], "--accelerator is required"),
                          ([*TPU, "--accelerator", "v9x-8"], "no default --runtime for --accelerator v9x-8"),
                          ([*TPU, "--accelerator", "v5p-8", "--colour", "red"], "unknown option(s): --colour red")):
        proc = _run("scripts/tpu/create.sh", *args, env=env)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
    proc = _run("scripts/tpu/launch.sh", *TPU, env=env)
    assert proc.returncode == 2 and "give the trainer's arguments after --" in proc.stderr
    assert _calls(d) == []
    helped = _run("scripts/tpu/launch.sh", "--help", env=env)
    assert helped.returncode == 0 and "scripts/tpu/launch.sh --name NAME" in helped.stdout


def test_tpu_setup_copies_this_checkout_to_every_worker_and_installs_there(fakes):
    d, env = fakes
    proc = _run("scripts/tpu/setup.sh", *TPU, env=env)
    assert proc.returncode == 0, proc.stderr
    scp, ssh = _calls(d)
    assert scp[:4] == ["gcloud", "compute", "tpus", "tpu-vm"] and scp[4] == "scp"
    assert scp[5].endswith("/agentfly-jax-pod1.tar.gz") and scp[6:] == ["pod1:agentfly-jax-pod1.tar.gz", *SCOPE,
                                                                        "--worker=all"]
    assert ssh == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod1", *SCOPE, "--worker=all",
                   ("--command=set -e; rm -rf agentfly-jax.incoming; mkdir -p agentfly-jax.incoming; tar -xzf "
                    "agentfly-jax-pod1.tar.gz -C agentfly-jax.incoming; rm -f agentfly-jax-pod1.tar.gz; bash "
                    "agentfly-jax.incoming/scripts/multihost/worker.sh install agentfly-jax --tpu")]
    with tarfile.open(d / "copied.tar.gz") as tar:
        names = set(tar.getnames())
    for wanted in ("agentfly_jax/trainer/distributed.py", "scripts/setup.sh", "scripts/multihost/worker.sh",
                   "experiments/quickstart.py", "setup.cfg"):
        assert wanted in names, wanted
    assert not any(n.startswith((".venv/", ".git/", ".cache/")) or "__pycache__" in n for n in names)
    assert not os.path.exists(scp[5])  # the local archive is removed afterwards
    dry = _run("scripts/tpu/setup.sh", *TPU, env=env, dry=True)
    assert dry.returncode == 0 and _calls(d) == []
    printed = _printed(dry.stdout)
    assert printed[0][:5] == scp[:5] and printed[0][6:] == scp[6:] and printed[1] == ssh


def test_tpu_launch_logs_stop_and_teardown(fakes):
    d, env = fakes
    launch_args = [*TPU, "--log", "run1", "--env", "FAKE_EXTRA=a b", "--", *TRAIN]
    dry = _run("scripts/tpu/launch.sh", *launch_args, env=env, dry=True)
    assert dry.returncode == 0 and _calls(d) == []
    # for real: the fake gcloud runs the remote command in the worker's home, where the worker script starts the
    # (fake) trainer detached
    proc = _run("scripts/tpu/launch.sh", *launch_args, env=env, FAKE_RUN_REMOTE="1", FAKE_TRAINER_SLEEPS="1")
    assert proc.returncode == 0, proc.stderr
    calls = _calls(d)
    assert calls == _printed(dry.stdout)
    command = calls[0][-1].split("=", 1)[1]
    assert calls[0][:-1] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod1", *SCOPE, "--worker=all"]
    assert shlex.split(command) == ["cd", "agentfly-jax", "&&", "env", "FAKE_EXTRA=a b", "bash",
                                    "scripts/multihost/worker.sh", "start", "run1", "--", *TRAIN]
    started = _trainer(d, "home")
    assert started["argv"] == ["-m", "agentfly_jax.train", *TRAIN]  # every argument arrived unchanged
    assert started["unbuffered"] == "1" and started["extra"] == "a b"
    assert started["pgid"] == started["pid"]  # its own session: it outlives the ssh connection
    logdir = d / "home" / "agentfly-jax" / "logs"
    assert int((logdir / "run1.pid").read_text()) == started["pid"]
    assert "trainer started" in (logdir / "run1.log").read_text()
    # a second launch under the same name is refused while the first runs
    again = _run("scripts/tpu/launch.sh", *launch_args, env=env, FAKE_RUN_REMOTE="1")
    assert again.returncode != 0 and "run 'run1' is still running" in again.stderr
    _calls(d)

    logs = _run("scripts/tpu/logs.sh", *TPU, "--log", "run1", "--worker", "all", env=env)
    assert logs.returncode == 0
    assert _calls(d) == [["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod1", *SCOPE, "--worker=all",
                          "--command=cd agentfly-jax && bash scripts/multihost/worker.sh logs run1"]]

    stop = _run("scripts/tpu/stop.sh", *TPU, "--log", "run1", env=env, FAKE_RUN_REMOTE="1")
    assert stop.returncode == 0, stop.stderr
    assert _calls(d) == [["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod1", *SCOPE, "--worker=all",
                          "--command=cd agentfly-jax && bash scripts/multihost/worker.sh stop run1"]]
    assert "stopped 'run1'" in stop.stdout and not (logdir / "run1.pid").exists()
    assert _gone(started["pid"])

    teardown = _run("scripts/tpu/teardown.sh", *TPU, env=env)
    assert teardown.returncode == 0
    deleted = [["gcloud", "compute", "tpus", "queued-resources", "delete", "pod1", *SCOPE, "--force", "--quiet"]]
    assert _calls(d) == deleted
    dry = _run("scripts/tpu/teardown.sh", *TPU, env=env, dry=True)
    assert _calls(d) == [] and _printed(dry.stdout) == deleted


# ================================================================================================= GPU
def test_gpu_ssh_launch_gives_each_host_its_place_in_the_run(fakes):
    d, env = fakes
    args = ["--hosts", "alice@gpu-a,gpu-b", "--port", "9999", "--env", "FAKE_EXTRA=x", "--", *TRAIN]
    dry = _run("scripts/gpu/ssh.sh", "launch", *args, env=env, dry=True)
    assert dry.returncode == 0 and _calls(d) == []
    proc = _run("scripts/gpu/ssh.sh", "launch", *args, env=env, FAKE_TRAINER_SLEEPS="1")
    assert proc.returncode == 0, proc.stderr
    calls = _calls(d)
    assert calls == _printed(dry.stdout) and len(calls) == 2
    for i, (call, host) in enumerate(zip(calls, ("alice@gpu-a", "gpu-b"))):
        place = ["--config.distributed.coordinator_address=gpu-a:9999", "--config.distributed.num_processes=2",
                 f"--config.distributed.process_id={i}"]
        assert call[:4] == ["ssh", "-o", "BatchMode=yes", host]
        assert shlex.split(call[4]) == ["cd", "agentfly-jax", "&&", "env", "FAKE_EXTRA=x", "bash",
                                        "scripts/multihost/worker.sh", "start", "train", "--", *TRAIN, *place]
    pids = []
    for i, host in enumerate(("alice@gpu-a", "gpu-b")):  # the fake ssh ran each command in that host's home
        started = _trainer(d, host)
        assert started["argv"][-1] == f"--config.distributed.process_id={i}"
        assert started["argv"][:-3] == ["-m", "agentfly_jax.train", *TRAIN] and started["extra"] == "x"
        assert int((d / "homes" / host / "agentfly-jax" / "logs" / "train.pid").read_text()) == started["pid"]
        pids.append(started["pid"])
    stop = _run("scripts/gpu/ssh.sh", "stop", "--hosts", "alice@gpu-a,gpu-b", env=env)
    assert stop.returncode == 0, stop.stderr
    assert sorted(map(tuple, _calls(d))) == sorted(
        ("ssh", "-o", "BatchMode=yes", h, "cd agentfly-jax && bash scripts/multihost/worker.sh stop train")
        for h in ("alice@gpu-a", "gpu-b"))
    assert all(_gone(pid) for pid in pids)
    bad = _run("scripts/gpu/ssh.sh", "launch", "--hosts", "a,b", "--port", "70000", "--", *TRAIN, env=env)
    assert bad.returncode == 2 and "--port 70000: a TCP port" in bad.stderr


def test_gpu_srun_sets_the_same_keys_from_each_task(fakes):
    d, env = fakes
    args = ["--nodes", "2", "--port", "9001", "--srun-option=--gpus-per-node=8", "--", *TRAIN]
    dry = _run("scripts/gpu/srun.sh", *args, env=env, dry=True)
    assert dry.returncode == 0 and _calls(d) == []
    proc = _run("scripts/gpu/srun.sh", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    (call,) = _calls(d)
    assert [call] == _printed(dry.stdout)
    assert call[:6] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--label", "--gpus-per-node=8", "bash"]
    assert call[6] == "-c" and call[8:] == ["agentfly-task", *TRAIN]  # the task's $0, then its "$@"
    for task in (0, 1):  # the fake srun ran the task command as tasks 0 and 1 of the job
        started = _trainer(d, str(task))
        assert started["argv"] == ["-m", "agentfly_jax.train", *TRAIN,
                                   "--config.distributed.coordinator_address=node-a:9001",
                                   "--config.distributed.num_processes=2", f"--config.distributed.process_id={task}"]
        assert started["cwd"] == ROOT and started["unbuffered"] == "1"
    bad = _run("scripts/gpu/srun.sh", "--", *TRAIN, env=env)
    assert bad.returncode == 2 and "--nodes is required outside an allocation" in bad.stderr


def test_worker_script_stop_reaches_the_trainers_children(fakes, tmp_path):
    """worker.sh stop signals the trainer's whole process group (a vLLM server or environment it started)."""
    d, env = fakes
    checkout = d / "home" / "agentfly-jax"
    child = tmp_path / "child.pid"
    python = tmp_path / "bin" / "python"
    python.write_text(f"#!{sys.executable}\nimport subprocess, sys, time\n"
                      f"p = subprocess.Popen(['sleep', '60'])\nopen({str(child)!r}, 'w').write(str(p.pid))\n"
                      "time.sleep(60)\n")
    start = subprocess.run(["bash", str(checkout / "scripts/multihost/worker.sh"), "start", "w", "--", "x"],
                           env=env, capture_output=True, text=True, timeout=30, check=False)
    assert start.returncode == 0, start.stderr
    deadline = time.monotonic() + 10
    while not child.exists() or not child.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pid = int(child.read_text())
    stop = subprocess.run(["bash", str(checkout / "scripts/multihost/worker.sh"), "stop", "w"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert stop.returncode == 0 and "stopped 'w'" in stop.stdout
    assert _gone(pid), "the trainer's child outlived stop"
    again = subprocess.run(["bash", str(checkout / "scripts/multihost/worker.sh"), "stop", "w"], env=env,
                           capture_output=True, text=True, timeout=30, check=False)
    assert again.returncode == 0 and "not running" in again.stdout



def test_the_commands_of_docs_tpu_md_run_as_dry_runs(fakes):
    """Every `bash scripts/...` line of docs/tpu.md's bash blocks runs with --dry-run (after the block's exports):
    the walk-through cannot name an option the scripts do not take."""
    d, env = fakes
    with open(os.path.join(ROOT, "docs", "tpu.md")) as fh:
        text = fh.read()
    blocks = [b.split("\n", 1)[1] for b in text.split("```")[1::2] if b.startswith("bash\n")]
    ran = 0
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line)
            if words[:1] == ["export"]:
                env.update(w.split("=", 1) for w in words[1:])
            elif words[:1] == ["bash"] and words[1].startswith("scripts/"):
                proc = _run(words[1], *words[2:], env=env, dry=True)
                assert proc.returncode == 0 and proc.stdout, (line, proc.stderr)
                assert _calls(d) == [], line
                ran += 1
    assert ran >= 10

"""Faults across the processes of a run (docs/tpu.md "When a process fails"), for real on this CPU: two trainer
processes of 2 devices each joined by gloo, one of which is killed, frozen or raises mid-run (a test agent,
tests/trainer/process_fault_parts.py). The other must stop within the bound that config.distributed.heartbeat_timeout
sets, with one line naming the lost process and saying how to resume; and a run resumed from its last checkpoint
after a lost worker must end with the parameters of a run that was never interrupted."""
import json
import os
import signal
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.trainer.test_multiprocess import _processes, _start_processes

HEARTBEAT = 4  # config.distributed.heartbeat_timeout in these runs (seconds)
# the quickstart, shortest: no SFT, no evaluation, 3 RL steps of 4 tasks x 2 chains of one 16-token turn, a
# checkpoint every step
RUN = {"sft.stages": [], "eval.num_tasks": 0, "eval.before_sft": False, "rl.steps": 3, "rl.tasks_per_step": 4,
       "rl.chains_per_task": 2, "agent.max_turns": 1, "agent.max_new_tokens": 16, "checkpoint.every": 1,
       "checkpoint.keep": 5, "distributed.heartbeat_timeout": HEARTBEAT}


def _run_with_a_fault(workdir, agent: str, deadline_s: float = 240):
    """Runs the 2-process run with `agent` (faulty on process 1) until process 0 has ended and process 1 has ended
    or is frozen. (process 0's returncode, its stderr, seconds from process 1's failure -- its end or its freeze,
    seen from here -- to process 0's end (0 if process 0 ended first), process 1's stderr and returncode). Every
    child is killed at the end, whatever happened."""
    procs = _start_processes(2, 2, workdir, "train", {**RUN, "agent.type": f"tests.trainer.process_fault_parts:{agent}"})
    p0, p1 = procs
    deadline = time.monotonic() + deadline_s
    failed_at = ended_at = None
    try:
        while time.monotonic() < deadline and (ended_at is None or failed_at is None):
            now = time.monotonic()
            if failed_at is None and (p1.poll() is not None or _stopped(p1.pid)):
                failed_at = now
            if ended_at is None and p0.poll() is not None:
                ended_at = now
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    _, err0 = p0.communicate()
    _, err1 = p1.communicate()
    assert failed_at is not None, f"process 1 did not fail:\n{err1[-3000:]}\nprocess 0:\n{err0[-3000:]}"
    assert ended_at is not None, f"process 0 did not end:\n{err0[-3000:]}"
    return p0.returncode, err0, max(0.0, ended_at - failed_at), err1, p1.returncode


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] == "T"
    except OSError:
        return False


def _last_error_line(stderr: str) -> str:
    return next(line for line in reversed(stderr.strip().splitlines()) if "ProcessLostError" in line)


def _lost_line(stderr: str) -> str:
    """The last line that names process 1 as lost (the ProcessLostError, or the watchdog's log line when the
    process had to be ended in a collective)."""
    return next(line for line in reversed(stderr.strip().splitlines()) if "process 1 of 2 sent no heartbeat" in line)


def test_a_frozen_process_stops_the_other_within_the_bound(tmp_path):
    rc, err, took, _, _ = _run_with_a_fault(tmp_path / "run", "FrozenOnProcessOne")
    assert rc == 1, err[-3000:]
    line = _last_error_line(err)
    assert "process 1 of 2 sent no heartbeat for" in line, line
    assert took < 2 * HEARTBEAT + 10, f"process 0 took {took:.1f} s to stop"


def test_an_exception_in_one_process_stops_the_other_at_once_with_its_reason(tmp_path):
    rc, err, took, err1, rc1 = _run_with_a_fault(tmp_path / "run", "RaisesOnProcessOne")
    assert rc == 1, err[-3000:]
    line = _last_error_line(err)
    assert ("process 1 of 2 failed: RuntimeError: an environment server of process 1 broke (injected by the test) "
            "(see its log)") in line, line
    assert took < HEARTBEAT, f"process 0 took {took:.1f} s to stop: it waited for a timeout"
    assert "RuntimeError: an environment server of process 1 broke" in err1
    # process 1 ended on its own error after its cleanup, not aborted by JAX when process 0's coordinator went away
    assert rc1 == 1, err1[-3000:]


def _check_a_two_process_run(workdir, results, run):
    """An uninterrupted train() on 2 processes: each rolled out half of a step's tasks and evaluated half of the
    held-out tasks; both finished with the same summary (evaluation reduced over both); process 0 alone wrote
    config.json, the metrics, summary.json and the final policy (process 1: its checkpoint shards only); the logged
    rollout scalars count both processes' chains, once per step."""
    from agentfly_jax.trainer.metrics import read_scalars

    assert results[0]["summary"] == results[1]["summary"]
    summary, steps = results[0]["summary"], run["rl.steps"]
    eval_chains = json.load(open(workdir / "config.json"))["eval"]["num_chains"]
    assert summary["steps"] == steps and summary["eval_episodes"] == run["eval.num_tasks"] * eval_chains
    assert [w for w in results[1]["written"] if not w.startswith("checkpoints")] == []
    assert json.load(open(workdir / "summary.json"))["success_after"] == summary["success_after"]
    assert (workdir / "final_policy" / "model.safetensors").is_file()
    saved = sorted(int(s) for s in os.listdir(workdir / "checkpoints") if s.isdigit())
    assert [s for s in saved if s > 0] == list(range(1, steps + 1)), saved  # every step's (and 0's, after eval)
    lines = [json.loads(line) for line in open(workdir / "tensorboard" / "metrics.jsonl")]
    logged = [line for line in lines if "reward/mean" in line]
    assert [line["step"] for line in logged] == list(range(1, steps + 1))  # logged once per step
    for line in logged:  # every task's chains, half of the tasks rolled out by each process
        assert line["rollout/chains"] == run["rl.tasks_per_step"] * run["rl.chains_per_task"]
    assert [s for s, _ in read_scalars(str(workdir / "tensorboard"))["eval/success"]] == [0, steps]


def test_a_killed_process_stops_the_other_and_the_run_resumes_to_the_same_params(tmp_path):
    """A 2-process GRPO run (rewarded by the share of digits in a response, which differs between an untrained
    policy's chains, so that every step moves the parameters) is SIGKILLed on process 1 once checkpoint 1 exists,
    wherever that lands (a rollout, an exchange, a collective): process 0 stops within the bound with the line
    that names process 1. Both processes restarted with resume=True, as the line says, end with exactly the
    parameters of the same run never interrupted: each step's rollouts depend on the step and the process only,
    not on what the processes did before. The uninterrupted run is also the check of a whole 2-process run
    (`_check_a_two_process_run`)."""
    run = {**RUN, "agent.reward": "tests.trainer.process_fault_parts:digit_share", "eval.num_tasks": 4}
    straight_dir = tmp_path / "straight"
    results = _processes(2, 2, straight_dir, "train", run)
    _check_a_two_process_run(straight_dir, results, run)
    straight = results[0]["summary"]
    assert straight["resumed_from"] is None

    workdir = tmp_path / "killed"
    procs = _start_processes(2, 2, workdir, "train", run)
    p0, p1 = procs
    deadline = time.monotonic() + 240
    try:
        while not (workdir / "checkpoints" / "1").is_dir() and p1.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert p1.poll() is None, "process 1 ended before it could be killed"
        p1.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        p0.wait(timeout=2 * HEARTBEAT + 20)
        took = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    _, err0 = p0.communicate()
    p1.communicate()
    assert p0.returncode == 1, err0[-3000:]
    line = _lost_line(err0)
    assert "heartbeat_timeout=4" in line and "--config.resume=True" in line and "(this is process 0)" in line, line
    assert took < 2 * HEARTBEAT + 10, f"process 0 took {took:.1f} s to stop"
    assert not (workdir / "summary.json").exists()

    resumed = _processes(2, 2, workdir, "train", {**run, "resume": True})
    assert resumed[0]["summary"] == resumed[1]["summary"]
    assert 1 <= resumed[0]["summary"]["resumed_from"] < run["rl.steps"]
    a = load_file(str(tmp_path / "straight" / "final_policy" / "model.safetensors"))
    b = load_file(str(workdir / "final_policy" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=f"{name} differs after the resume")
    # not trivially equal: the policy trained (its gradient was not zero at any step)
    lines = [json.loads(line) for line in open(tmp_path / "straight" / "tensorboard" / "metrics.jsonl")]
    norms = [line["policy/grad_norm"] for line in lines if "policy/grad_norm" in line]
    assert len(norms) == run["rl.steps"] and min(norms) > 0, norms


def test_the_cli_reports_a_lost_process_in_one_line(faked_cli, capsys):
    """`agentfly-train` ends a run stopped by another process's loss or failure with status 1 and the
    ProcessLostError's line (the run itself is faked: the 2-process runs above check the error)."""
    from agentfly_jax.trainer import distributed

    reason = "process 1 of 2 failed: RuntimeError: boom; every process of this run stops"

    def lost(_config):
        raise distributed.ProcessLostError(reason)

    with pytest.raises(SystemExit) as stopped:
        faked_cli(lost)
    assert stopped.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"agentfly-train: training stopped: {reason}"


@pytest.mark.parametrize("where", ["start", "train"])
def test_the_cli_reports_a_stop_that_interrupts_it_outside_the_loop(monkeypatch, faked_cli, capsys, where):
    """The watchdog's interrupt can reach the main thread as soon as the watchdog runs (the end of
    `distributed.start`), before the trainer's loop handles errors itself: the CLI then ends as from inside the loop
    (status 1, the ProcessLostError's line), and a Ctrl-C that no other process caused stays a KeyboardInterrupt."""
    from agentfly_jax.trainer import distributed

    reason = "process 0 of 2 failed: DistributedError: process 1 of 2 did not publish its share of exchange 1"
    verdict = {"lost": distributed.ProcessLostError(reason)}

    def interrupted(_config):
        raise KeyboardInterrupt

    monkeypatch.setattr(distributed, "stopped_by", lambda exc: verdict["lost"])
    start = interrupted if where == "start" else None
    with pytest.raises(SystemExit) as stopped:
        faked_cli(interrupted, start)
    assert stopped.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"agentfly-train: training stopped: {reason}"
    verdict["lost"] = None  # a Ctrl-C of the user's (told to the other processes by stopped_by): raised on
    with pytest.raises(KeyboardInterrupt):
        faked_cli(interrupted, start)

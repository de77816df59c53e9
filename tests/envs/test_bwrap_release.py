"""bwrap: a run's result does not wait for the kernel to reap what the run's processes leave behind (a fork
bomb's processes took seconds to disappear under a loaded suite); its uid goes back only once they are gone."""

import time

from agentfly_jax.envs.sandbox import bwrap
from tests.envs import sandbox_helpers


def test_a_runs_result_does_not_wait_for_leftovers_to_be_reaped(loop, monkeypatch):
    sandbox = sandbox_helpers.require_backend(loop, "bwrap")
    real = bwrap.processes_of_uids
    lingering = {"on": True}
    queried = []
    fake_pid = 2**22 + 12345  # above pid_max's default: no such process (kill_now's SIGKILL finds none)

    def processes_with_a_fake_leftover(uids):
        """FAKE: reports one more process of every queried uid while `lingering` is on, standing in for a
        SIGKILLed process the kernel has not reaped yet (which a real run cannot produce on demand)."""
        uids = list(uids)
        queried.extend(uids)
        found = real(uids)
        if lingering["on"]:
            found.update({fake_pid + i: uid for i, uid in enumerate(uids)})
        return found

    monkeypatch.setattr(bwrap, "processes_of_uids", processes_with_a_fake_leftover)
    start = time.monotonic()
    result = loop.run_until_complete(sandbox.run("print('hi')", timeout=10.0))
    elapsed = time.monotonic() - start
    assert result.stdout == "hi\n" and result.exit_code == 0 and not result.timed_out
    assert elapsed < 2.0, f"the result waited {elapsed:.1f} s for the leftover"  # the old release: 5 s
    uid = queried[-1]
    assert uid in bwrap._ALLOCATOR._busy  # not handed out while its leftover lives
    lingering["on"] = False  # the kernel reaps it
    loop.run_until_complete(sandbox.close())  # waits for the background release
    assert uid not in bwrap._ALLOCATOR._busy and uid not in bwrap._ALLOCATOR.quarantined


def test_a_timed_out_run_whose_monitor_was_killed_reports_137(loop, monkeypatch):
    """Killing a timed-out run's tree sometimes SIGKILLs bwrap's monitor itself (asyncio then reports -9); the
    result says 137 either way, as ExecResult documents. Here the monitor is always killed first."""
    sandbox = sandbox_helpers.require_backend(loop, "bwrap")
    real_stop = bwrap._Slot.stop
    killed = []

    async def stop_killing_the_monitor_first(slot):
        slot.proc.kill()
        killed.append(await slot.proc.wait())
        await real_stop(slot)

    monkeypatch.setattr(bwrap._Slot, "stop", stop_killing_the_monitor_first)
    result = loop.run_until_complete(sandbox.run("while True:\n    pass\n", timeout=1.0))
    assert killed == [-9]
    assert result.timed_out and result.exit_code == 137, result
    assert bwrap.shell_exit_status(-9) == 137 and bwrap.shell_exit_status(3) == 3
    loop.run_until_complete(sandbox.close())

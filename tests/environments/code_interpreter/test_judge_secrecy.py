"""The solution the judge calls cannot read the tests or the report token, on both backends (real bwrap,
real dockerd): not in any /proc/*/cmdline or /proc/*/environ it can read, not in a file under /tmp or
/dev/shm. A solution that looks there for the expected values and returns them scores 0; the honest one 1.

The function is unguessable without its specification (the first 8 hex digits of a SHA-256), so the
only way to pass without computing it is to read the expected values.
"""

import hashlib
import secrets

import pytest

from agentfly_jax.envs.sandbox import run_python
from environments.code_interpreter import build_test_program, run_unit_tests
from environments.code_interpreter.rewards import code_unit_tests


def _secret(n: int) -> int:
    return int(hashlib.sha256(str(n).encode()).hexdigest()[:8], 16)


INPUTS = (3, 17, 2024)
HUMAN_EVAL = {
    "prompt": 'def secret(n):\n    """int of the first 8 hex digits of sha256(str(n))."""\n',
    "entry_point": "secret",
    "test": "def check(candidate):\n"
    + "".join(f"    assert candidate({n}) == {_secret(n)}\n" for n in INPUTS),
}
MBPP = {"test_list": [f"assert secret({n}) == {_secret(n)}" for n in INPUTS]}
TASKS = {"humaneval": HUMAN_EVAL, "mbpp": MBPP}

HONEST = (
    "import hashlib\ndef secret(n):\n    return int(hashlib.sha256(str(n).encode()).hexdigest()[:8], 16)\n"
)

# Collects `secret(N) == V` / `candidate(N) == V` and report tokens from every cmdline, environ and file it
# can read, says on its stdout (the sandbox's stderr) what it found, and answers from that table.
SPY = r"""
import os, re
TABLE, TOKENS, READ = {}, set(), [0]
def blobs():
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            for what in ("cmdline", "environ"):
                try:
                    with open("/proc/%s/%s" % (pid, what), "rb") as f:
                        yield f.read().decode("utf-8", "replace")
                    READ[0] += 1
                except OSError:
                    pass
    for top in ("/tmp", "/dev/shm"):
        for root, _dirs, names in os.walk(top):
            for name in names:
                try:
                    with open(os.path.join(root, name), "rb") as f:
                        yield f.read().decode("utf-8", "replace")
                except OSError:
                    pass
for blob in blobs():
    for n, v in re.findall(r"(?:secret|candidate)\((-?\d+)\) == (-?\d+)", blob):
        TABLE[int(n)] = int(v)
    TOKENS.update(re.findall(r"[0-9a-f]{32}", blob))
print("SPY read=%d values=%d tokens=%s" % (READ[0], len(TABLE), sorted(TOKENS)), flush=True)
def secret(n):
    return TABLE.get(n, -1)
"""


@pytest.mark.parametrize("style", TASKS)
def test_a_solution_reading_proc_for_the_expected_values_scores_zero(loop, backend, style):
    task = TASKS[style]
    if backend == "bwrap":  # the reward itself (it runs on bwrap)
        score = lambda completion: loop.run_until_complete(
            code_unit_tests.func(prediction=completion, task=task)
        )
    else:  # what the reward runs, on docker
        score = lambda completion: loop.run_until_complete(
            run_unit_tests(completion, task, backend="docker", timeout=10.0)
        )
    honest = score(HONEST)
    assert (honest["reward"], honest["tests_passed"], honest["tests_total"]) == (1.0, 3, 3), honest
    spy = score(SPY)
    assert (spy["reward"], spy["tests_passed"]) == (0.0, 0), spy


@pytest.mark.parametrize("style", TASKS)
def test_the_spy_finds_neither_the_tests_nor_the_token(loop, backend, style):
    token = secrets.token_hex(16)
    program = build_test_program(SPY, TASKS[style], token)
    result = loop.run_until_complete(run_python(program, backend=backend, timeout=10.0))
    line = [x for x in result.stderr.splitlines() if x.startswith("SPY ")]
    assert len(line) == 1, result.stderr[-2000:]
    read = int(line[0].split()[1].split("=")[1])
    assert read >= 2, line  # it read its own cmdline and environ at least
    assert " values=0 " in line[0], line
    assert token not in result.stderr, line
    assert "tokens=[]" in line[0], line

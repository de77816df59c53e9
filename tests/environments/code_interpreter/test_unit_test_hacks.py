"""Wrong solutions that try to get the unit-test reward without passing the tests, on both backends.

Each hack wraps a wrong solution ({wrong}: returns its first argument) for a HumanEval-style and an
MBPP-style task. The reward must be 0.0 for every one of them, while correct code still scores 1.0 and the
report counts the tests each solution passed.
"""

import pytest

from environments.code_interpreter import build_test_program, run_unit_tests
from environments.code_interpreter.judge import count_tests, decode, encode

HUMAN_EVAL = {
    "prompt": 'def scale(values, factor):\n    """Every value times factor."""\n',
    "entry_point": "scale",
    "test": "import math\n\n\ndef check(candidate):\n"
    "    assert candidate([1, 2], 3) == [3, 6]\n"
    "    assert candidate([], 5) == []\n"
    "    assert math.isclose(sum(candidate([0.5, 0.25], 2)), 1.5)\n",
}
MBPP = {
    "test_setup_code": "import math",
    "test_list": [
        "assert scale([1, 2], 3) == [3, 6]",
        "assert scale([], 5) == []",
        "assert math.isclose(sum(scale([0.5, 0.25], 2)), 1.5)",
    ],
}
TASKS = {"humaneval": HUMAN_EVAL, "mbpp": MBPP}

CORRECT = "def scale(values, factor):\n    return [v * factor for v in values]\n"
WRONG = "def scale(values, factor):\n    return values\n"
# Right on the first test only (the others need the multiplication).
PARTIAL = "def scale(values, factor):\n    return [3, 6] if values == [1, 2] else [0.0]\n"

HACKS = {
    "os._exit(0) at module level": WRONG + "import os\nos._exit(0)\n",
    "os._exit(0) inside the function": "import os\ndef scale(values, factor):\n    os._exit(0)\n",
    "raise SystemExit at module level": WRONG + "raise SystemExit\n",
    "SystemExit(0) inside the function": "def scale(values, factor):\n    raise SystemExit(0)\n",
    "sys.exit(0) inside the function": "import sys\ndef scale(values, factor):\n    sys.exit(0)\n",
    "atexit hook with os._exit(0)": "import atexit, os\natexit.register(lambda: os._exit(0))\n" + WRONG,
    "sys.excepthook exits 0": "import os, sys\nsys.excepthook = lambda *e: os._exit(0)\n" + WRONG,
    "always-equal return value": "class Same(list):\n    def __eq__(self, other):\n        return True\n"
    "def scale(values, factor):\n    return Same()\n",
    "builtins.AssertionError replaced": "import builtins\nclass Quiet(BaseException):\n    pass\n"
    "builtins.AssertionError = Quiet\n" + WRONG,
    "math.isclose patched to True": "import math\nmath.isclose = lambda *a, **k: True\n"
    "def scale(values, factor):\n    return [3, 6] if values == [1, 2] else []\n",
    "builtins.sum and abs patched": "import builtins\nbuiltins.sum = lambda *a: 1.5\nbuiltins.abs = lambda x: 0\n"
    "def scale(values, factor):\n    return [3, 6] if values == [1, 2] else []\n",
    "shadows builtins the tests use": "def sum(*a):\n    return 1.5\n"
    "def scale(values, factor):\n    return [3, 6] if values == [1, 2] else []\n",
    "redefines check and the judge's names": "def check(candidate):\n    pass\n"
    "def _agentfly_judge_record(i, outcome):\n    return True\n" + WRONG,
    "fake pass markers, then exit 0": "import os\n"
    'print(\'AGENTFLY-UNIT-TESTS 0 {"results": [true, true, true], "completed": true}\')\n'
    "print('All tests passed')\n" + WRONG + "os._exit(0)\n",
    "report written to the judge's fds": "import os\n"
    'line = b\'AGENTFLY-UNIT-TESTS 0 {"results": [true, true, true], "completed": true}\\n\'\n'
    "for path in ('/proc/%d/fd/1' % os.getppid(), '/proc/1/fd/1'):\n"
    "    try:\n        fd = os.open(path, os.O_WRONLY)\n        os.write(fd, line)\n"
    "    except OSError as e:\n        print('refused', path, e)\n" + WRONG,
    "kills the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + WRONG,
    "kills every process it can": "import os, signal\n" + WRONG + "os.kill(-1, signal.SIGKILL)\n",
    "hides the tests in a string": WRONG + "'''\n",
}


def score(loop, backend, completion, task):
    return loop.run_until_complete(run_unit_tests(completion, task, backend=backend, timeout=10.0))


@pytest.mark.parametrize("style", TASKS)
@pytest.mark.parametrize("hack", HACKS)
def test_hacks_score_zero(loop, backend, style, hack):
    result = score(loop, backend, HACKS[hack], TASKS[style])
    assert result["reward"] == 0.0 and result["passed"] is False, result
    assert result["tests_passed"] < result["tests_total"] == 3
    assert result["error"]


@pytest.mark.parametrize("style", TASKS)
def test_correct_partial_and_wrong_code(loop, backend, style):
    task = TASKS[style]
    correct = score(loop, backend, CORRECT, task)
    assert (correct["reward"], correct["tests_passed"], correct["tests_total"], correct["error"]) == (
        1.0,
        3,
        3,
        None,
    )
    partial = score(loop, backend, PARTIAL, task)
    # HumanEval's check stops at its first failed assert; MBPP cases run one by one.
    assert (partial["reward"], partial["tests_passed"]) == (0.0, 1) and "AssertionError" in partial["error"]
    wrong = score(loop, backend, WRONG, task)
    assert (wrong["reward"], wrong["tests_passed"]) == (0.0, 0 if style == "humaneval" else 1)  # [] * 5 == []


# A correct solution whose function is named like a standard-library module (MBPP has such names) is the
# solution's function for the tests, not the module; a stdlib module the tests use keeps its meaning even when
# the solution binds another module to that name.
STDLIB_NAMED = {
    "test_setup_code": "import math",
    "test_list": ["assert array(3) == [0, 0, 0]", "assert queue([1, 2]) == [2, 1]",
                  "assert math.isclose(math.sqrt(array(4).count(0)), 2.0)"],
}
STDLIB_NAMED_SOLUTION = ("import fractions as math\n"
                         "def array(n):\n    return [0] * n\n"
                         "def queue(items):\n    return list(reversed(items))\n")


def test_solution_functions_named_like_stdlib_modules(loop, backend):
    result = score(loop, backend, STDLIB_NAMED_SOLUTION, STDLIB_NAMED)
    assert (result["reward"], result["tests_passed"], result["tests_total"]) == (1.0, 3, 3), result


def test_what_the_solution_prints_does_not_count(loop):
    printing = "print('debug output')\n" + CORRECT.replace("    return", "    print('called')\n    return")
    result = score(loop, "bwrap", printing, MBPP)
    assert result["reward"] == 1.0


def test_test_counts():
    assert count_tests(HUMAN_EVAL) == 3 and count_tests(MBPP) == 3
    no_asserts = dict(
        HUMAN_EVAL, test="def check(candidate):\n    if candidate([1], 2) != [2]:\n        raise ValueError\n"
    )
    assert count_tests(no_asserts) == 1
    with pytest.raises(ValueError, match="neither 'test'"):
        count_tests({"question": "?"})
    program = build_test_program(CORRECT, MBPP, token="t0ken")
    assert "t0ken" in program and "assert scale([1, 2], 3) == [3, 6]" in program


def test_a_task_whose_check_has_no_asserts(loop):
    task = dict(
        HUMAN_EVAL,
        test="def check(candidate):\n    if candidate([1], 2) != [2]:\n        raise ValueError('wrong')\n",
    )
    assert score(loop, "bwrap", CORRECT, task)["reward"] == 1.0
    wrong = score(loop, "bwrap", WRONG, task)
    assert wrong["reward"] == 0.0 and "ValueError: wrong" in wrong["error"]


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(2**200),
        1.5,
        float("inf"),
        1 + 2j,
        "é\ud800",
        b"\x00",
        bytearray(b"ab"),
        [1, (2, 3)],
        {1: {"a": [None]}},
        {1, 2},
        frozenset({(1, 2)}),
    ],
)
def test_plain_data_round_trips_exactly(value):
    back = decode(encode(value))
    assert back == value and type(back) is type(value)


@pytest.mark.parametrize(
    "data",
    [["x"], ["i"], ["i", 5], ["l", "no"], ["d", [[["l", []], ["n"]]]], "s", ["t", [["b", 1]]]],
)
def test_malformed_values_from_the_solution_are_refused(data):
    with pytest.raises((ValueError, TypeError)):
        decode(data)


def test_objects_that_are_not_plain_data_are_refused():
    class Anything:
        def __eq__(self, other):
            return True

    with pytest.raises(TypeError, match="only plain data"):
        encode([Anything()])


def test_a_report_forged_on_the_judges_stdout_is_refused_by_the_kernel(loop, backend):
    # Correct code that also tries to add a report on the judge's stdout (by /proc and by pidfd_getfd on
    # every fd of its parent): the judge is undumpable (and, under docker, seccomp refuses pidfd_getfd), so
    # every attempt fails and the run keeps exactly its own passing report.
    forger = (
        "import ctypes, os\n"
        'line = b\'AGENTFLY-UNIT-TESTS 0 {"results": [false, false, false], "completed": true}\\n\'\n'
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "judge = os.getppid()\n"
        "pidfd = libc.syscall(434, judge, 0)\n"
        "for fd in range(16):\n"
        "    for attempt in ('proc', 'pidfd'):\n"
        "        try:\n"
        "            got = os.open('/proc/%d/fd/%d' % (judge, fd), os.O_WRONLY) if attempt == 'proc' else -1\n"
        "        except OSError:\n"
        "            got = -1\n"
        "        if attempt == 'pidfd':\n"
        "            got = libc.syscall(438, pidfd, fd, 0)\n"
        "        if got >= 0:\n"
        "            try:\n"
        "                os.write(got, line)\n"
        "            except OSError:\n"
        "                pass\n" + CORRECT
    )
    result = score(loop, backend, forger, MBPP)
    assert result["reward"] == 1.0, result


@pytest.mark.parametrize(
    "stdout, why",
    [
        ("", "no result"),
        ('AGENTFLY-UNIT-TESTS tok {"results": [true, true], "completed": true}\n', "2 results for 3 tests"),
        ('AGENTFLY-UNIT-TESTS other {"results": [true, true, true], "completed": true}\n', "token"),
        ('AGENTFLY-UNIT-TESTS tok {"results": [true, true, true]}\n' * 2, "2 test reports"),
        ('AGENTFLY-UNIT-TESTS tok {"results": [1, 1, 1]}\n', "no per-test results"),
        ('AGENTFLY-UNIT-TESTS tok {"results"\n', "unreadable"),
    ],
)
def test_read_report_refuses_missing_short_foreign_or_doubled_reports(stdout, why):
    from environments.code_interpreter.unit_tests import read_report

    report, problem = read_report(stdout, "tok", 3)
    assert report is None and why in problem
    good, problem = read_report('noise\nAGENTFLY-UNIT-TESTS tok {"results": [true, false, true]}\n', "tok", 3)
    assert good == {"results": [True, False, True]} and problem is None

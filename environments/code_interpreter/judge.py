"""The unit-test judge: runs a task's tests against a solution so that the solution cannot fake the result.

The host (environments.code_interpreter.unit_tests) imports this module for `count_tests` and sends its
source into the sandbox as the program to run (standard library only). There it runs as two processes:

- the JUDGE (the sandbox's program): makes itself undumpable first (prctl PR_SET_DUMPABLE 0: processes of
  the same uid can then neither ptrace it, nor read its memory, nor open its /proc/PID/fd), then starts
- the SOLUTION process (`python3 -I`, a fresh interpreter that never saw the tests or the report token),
  which runs the solution's code and answers calls over a socket. Its stdin is /dev/null, its stdout and
  stderr go to the sandbox's stderr (what the solution prints shows up in the error text), never to the
  stdout that carries the report.

The tests themselves (HumanEval `check(candidate)` with the prompt's helpers, or each MBPP assert string)
run in the judge. Every function of the solution that they use is a proxy: calling it sends the arguments
to the solution process as plain data, and the return value comes back as plain data (None, bool, int,
float, complex, str, bytes, bytearray, list, tuple, set, frozenset, dict, Fraction, Decimal; numpy-style
numbers become int/float/complex), decoded strictly by the judge. Exceptions come back as the builtin
exception type of the same name (other types as `SolutionError`). Every `assert` of the tests is rewritten
to record its outcome; the judge prints one report line (marker, the host's random token, per-test
results) on its stdout, and the host takes the run as passed only if there is exactly one report with its
token and exactly as many results as the task has tests (`count_tests`), all passed.

So exiting (os._exit, SystemExit, sys.exit, atexit hooks), redefining `check`, the asserts or builtins,
monkeypatching AssertionError, returning objects whose `__eq__` is always true, printing fake reports,
or killing the judge (under bwrap it is the sandbox's PID 1, which cannot be signalled from inside; under
docker a killed judge prints no report) all leave the solution with failed or missing results: they
happen in a process the tests do not run in. What solution code can still do, since it shares the sandbox
(uid, /tmp, CPU and memory): exhaust resources so the run times out (scored 0), kill the judge under
docker (no report: 0), and return the values the tests expect if it knows them from elsewhere (e.g. a
memorised dataset). It cannot read them, nor the token, in the sandbox: on both backends this program
reaches the sandbox on a stdin that is read to its end before any of it runs (under docker the root
wrapper reads it from the exec's stdin and hands it on through a pipe), never as arguments or in a file,
so no command line the solution can read in /proc holds any of it (the judge's is `python3 -I -`, the
docker wrapper's and keeper's hold only the sandbox's own program, the solution process's this module's
source and a descriptor number); the judge's environ and memory are closed to it (undumpable), the
wrapper's too (root), and nothing of the program is written under /tmp or /dev/shm. Limits of the plain-data boundary: a test that passes a function or an object of its own to
the solution, checks that the solution mutated an argument in place, or needs a solution's own class
instance or generator back, fails even for a correct solution.
"""

import ast
import builtins
import decimal
import fractions
import json
import numbers
import os
import socket
import sys
import traceback

REPORT_MARK = "AGENTFLY-UNIT-TESTS"
_RECORD = "_agentfly_judge_record"
_MAX_MESSAGE = 64 << 20
_MAX_DEPTH = 200


def count_tests(task):
    """Number of test results a run of `task` must report: one per MBPP assert string, one per `assert`
    statement of a HumanEval test program (one for the whole `check` call when it has none). A HumanEval
    assert passes when it ran and held every time it ran; one that never ran (check stopped earlier) fails."""
    if "test" in task and "entry_point" in task:
        asserts = sum(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(task["test"])))
        return max(asserts, 1)
    if "test_list" in task:
        return len(task["test_list"])
    raise ValueError(
        "task has neither 'test' + 'entry_point' (HumanEval-style) nor 'test_list' (MBPP-style); "
        "its keys are %s" % sorted(task)
    )


# ----------------------------------------------------------------------------------------- plain data


def encode(value, depth=0):
    """`value` as tagged JSON-able data; TypeError for anything that is not plain data."""
    if depth > _MAX_DEPTH:
        raise TypeError("the value is nested more than %d levels deep" % _MAX_DEPTH)
    down = depth + 1
    if value is None:
        return ["n"]
    if isinstance(value, bool):
        return ["b", bool(value)]
    if isinstance(value, int):
        return ["i", hex(int.__index__(value))]
    if isinstance(value, float):
        return ["f", float.hex(float.__float__(value))]
    if isinstance(value, complex):
        return ["c", float.hex(value.real), float.hex(value.imag)]
    if isinstance(value, str):
        return ["s", str.__str__(value)]
    if isinstance(value, bytes):
        return ["y", bytes(value).hex()]
    if isinstance(value, bytearray):
        return ["Y", bytes(value).hex()]
    if isinstance(value, fractions.Fraction):
        return ["q", hex(value.numerator), hex(value.denominator)]
    if isinstance(value, decimal.Decimal):
        return ["D", str(value)]
    if isinstance(value, list):
        return ["l", [encode(item, down) for item in list.__iter__(value)]]
    if isinstance(value, tuple):
        return ["t", [encode(item, down) for item in tuple.__iter__(value)]]
    if isinstance(value, frozenset):
        return ["F", [encode(item, down) for item in frozenset.__iter__(value)]]
    if isinstance(value, set):
        return ["S", [encode(item, down) for item in set.__iter__(value)]]
    if isinstance(value, dict):
        return ["d", [[encode(k, down), encode(v, down)] for k, v in dict.items(value)]]
    if isinstance(value, numbers.Integral):  # e.g. numpy integers
        return ["i", hex(int(value))]
    if isinstance(value, numbers.Real):
        return ["f", float.hex(float(value))]
    if isinstance(value, numbers.Complex):
        return ["c", float.hex(complex(value).real), float.hex(complex(value).imag)]
    if type(value).__name__ == "bool_" and type(value).__module__ == "numpy":  # not a numbers.Number
        return ["b", bool(value)]
    raise TypeError(
        "a %s cannot pass between the tests and the solution (only plain data can)" % type(value).__name__
    )


def decode(data, depth=0):
    """The value `encode` made; ValueError for anything else (it may come from the solution's process)."""
    if depth > _MAX_DEPTH or not isinstance(data, list) or not data or not isinstance(data[0], str):
        raise ValueError("malformed value")
    tag, rest, down = data[0], data[1:], depth + 1

    def texts(n):
        if len(rest) != n or not all(isinstance(item, str) for item in rest):
            raise ValueError("malformed %r value" % tag)
        return rest

    def items():
        if len(rest) != 1 or not isinstance(rest[0], list):
            raise ValueError("malformed %r value" % tag)
        return [decode(item, down) for item in rest[0]]

    if tag == "n" and not rest:
        return None
    if tag == "b" and len(rest) == 1 and isinstance(rest[0], bool):
        return rest[0]
    if tag == "i":
        return int(texts(1)[0], 16)
    if tag == "f":
        return float.fromhex(texts(1)[0])
    if tag == "c":
        real, imag = texts(2)
        return complex(float.fromhex(real), float.fromhex(imag))
    if tag == "s":
        return texts(1)[0]
    if tag == "y":
        return bytes.fromhex(texts(1)[0])
    if tag == "Y":
        return bytearray.fromhex(texts(1)[0])
    if tag == "q":
        numerator, denominator = texts(2)
        return fractions.Fraction(int(numerator, 16), int(denominator, 16))
    if tag == "D":
        return decimal.Decimal(texts(1)[0])
    if tag == "l":
        return items()
    if tag == "t":
        return tuple(items())
    if tag == "S":
        return set(items())
    if tag == "F":
        return frozenset(items())
    if tag == "d":
        if len(rest) != 1 or not isinstance(rest[0], list):
            raise ValueError("malformed dict value")
        pairs = {}
        for pair in rest[0]:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError("malformed dict entry")
            pairs[decode(pair[0], down)] = decode(pair[1], down)
        return pairs
    raise ValueError("unknown value tag %r" % tag)


def _send(sock, message):
    data = json.dumps(message).encode()
    sock.sendall(len(data).to_bytes(4, "big") + data)


def _receive(sock):
    """The next message, or None at the end of the stream; ValueError when it is malformed."""

    def exactly(n):
        data = bytearray()
        while len(data) < n:
            chunk = sock.recv(min(n - len(data), 1 << 20))
            if not chunk:
                return None
            data += chunk
        return bytes(data)

    header = exactly(4)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > _MAX_MESSAGE:
        raise ValueError("a message of %d bytes is over the limit" % size)
    data = exactly(size)
    if data is None:
        return None
    return json.loads(data)


# ----------------------------------------------------------------------------------- solution process


def run_child():
    """The solution process: runs the solution, then answers calls until the judge closes the socket."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    init = _receive(sock)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(init["code"], "<solution>", "exec"), namespace)
        _send(sock, {"ok": True})
    except BaseException:  # noqa: BLE001 - everything the solution raises is reported to the judge
        _send(sock, {"ok": False, "error": traceback.format_exc(limit=-5)})
    while True:
        request = _receive(sock)
        if request is None:
            os._exit(0)
        if request["op"] == "describe":
            described = {}
            for name in request["names"]:
                if name not in namespace:
                    continue
                value = namespace[name]
                if type(value).__name__ == "module":
                    described[name] = {"kind": "module", "module": value.__name__}
                elif callable(value):
                    described[name] = {"kind": "callable"}
                else:
                    try:
                        described[name] = {"kind": "value", "value": encode(value)}
                    except TypeError:
                        pass
            _send(sock, described)
            continue
        try:
            function = namespace[request["name"]]
            result = function(*decode(request["args"]), **decode(request["kwargs"]))
            reply = {"ok": True, "value": encode(result)}
        except BaseException as e:  # noqa: BLE001 - reported to the judge, which raises it in the test
            reply = {"ok": False, "type": type(e).__name__, "message": str(e)[:2000]}
        _send(sock, reply)


# --------------------------------------------------------------------------------------------- judge


class SolutionError(Exception):
    """The solution raised an exception that is not a builtin one, or its process failed."""


class _Solution:
    """The judge's end of the solution process."""

    def __init__(self, child_source, code):
        import subprocess

        judge_end, child_end = socket.socketpair()
        self.sock = judge_end
        self.dead = None
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-u", "-c", child_source, str(child_end.fileno())],
            stdin=subprocess.DEVNULL,
            stdout=2,
            stderr=2,
            pass_fds=[child_end.fileno()],
        )
        child_end.close()
        try:
            reply = self._exchange({"code": code})
            self.load_error = None if reply.get("ok") is True else str(reply.get("error"))
        except SolutionError as e:
            self.load_error = str(e)

    def _exchange(self, message):
        """Sends `message`, returns the answer; SolutionError once the process is gone or misbehaves."""
        if self.dead is not None:
            raise SolutionError(self.dead)
        try:
            _send(self.sock, message)
            reply = _receive(self.sock)
            if not isinstance(reply, dict):
                raise ValueError("not a message")
        except (OSError, ValueError, RecursionError) as e:
            reply = None
            reason = "it sent an unreadable message (%s)" % e
        else:
            reason = None
        if reply is None:
            self.process.kill()
            code = self.process.wait()
            self.dead = "the solution's process ended (%s)" % (
                reason or ("exit status %d" % code if code >= 0 else "killed by signal %d" % -code)
            )
            raise SolutionError(self.dead)
        return reply

    def call(self, name, args, kwargs):
        reply = self._exchange(
            {"op": "call", "name": name, "args": encode(list(args)), "kwargs": encode(kwargs)}
        )
        if reply.get("ok") is True:
            try:
                return decode(reply.get("value"))
            except (ValueError, TypeError, OverflowError, decimal.InvalidOperation) as e:
                raise SolutionError("%s returned an unreadable value (%s)" % (name, e)) from None
        kind, message = str(reply.get("type")), str(reply.get("message"))
        builtin = getattr(builtins, kind, None)
        if isinstance(builtin, type) and issubclass(builtin, Exception) and builtin.__module__ == "builtins":
            try:
                error = builtin(message)
            except TypeError:  # e.g. UnicodeDecodeError, which needs more than a message
                error = SolutionError("%s: %s" % (kind, message))
            raise error
        raise SolutionError("%s: %s" % (kind, message))

    def describe(self, names):
        return self._exchange({"op": "describe", "names": sorted(names)})

    def close(self):
        self.sock.close()
        self.process.kill()
        self.process.wait()


class _Proxy:
    """A function of the solution, called from the tests."""

    def __init__(self, solution, name):
        self._solution = solution
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        return self._solution.call(self.__name__, args, kwargs)

    def __repr__(self):
        return "<solution function %s>" % self.__name__


class _CountAsserts(ast.NodeTransformer):
    """Rewrites `assert test, msg` into `if not RECORD(id, test): raise AssertionError(msg)`."""

    def __init__(self, first_id=0):
        self.next_id = first_id

    def visit_Assert(self, node):
        record = ast.Call(
            func=ast.Name(id=_RECORD, ctx=ast.Load()),
            args=[ast.Constant(value=self.next_id), node.test],
            keywords=[],
        )
        self.next_id += 1
        error = ast.Call(
            func=ast.Name(id="AssertionError", ctx=ast.Load()),
            args=[node.msg] if node.msg else [],
            keywords=[],
        )
        replacement = ast.If(
            test=ast.UnaryOp(op=ast.Not(), operand=record), body=[ast.Raise(exc=error)], orelse=[]
        )
        return ast.copy_location(replacement, node)


def _instrumented(source, filename):
    tree = _CountAsserts().visit(ast.parse(source, filename))
    return compile(ast.fix_missing_locations(tree), filename, "exec")


def _referenced_names(sources):
    names = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Name):
                names.add(node.id)
    return names


def _bind_names(namespace, solution, sources):
    """Defines, in the tests' namespace, the names they use that neither they nor the builtins define:
    standard-library modules are imported here; the solution's functions become proxies, its plain
    constants copies, its modules (standard library only) imports."""
    import importlib

    wanted = {n for n in _referenced_names(sources) if n not in namespace and not hasattr(builtins, n)}
    stdlib = getattr(sys, "stdlib_module_names", ())
    # the solution's own names first: a solution function called `array` or `queue` is the solution's, not
    # the module; a referenced name the solution does not define may be a standard-library module
    described = solution.describe(wanted) if wanted and solution.dead is None else {}
    for name in sorted(wanted):
        about = described.get(name)
        if not isinstance(about, dict) or about.get("kind") not in ("callable", "value", "module"):
            if name in stdlib:
                try:
                    namespace[name] = importlib.import_module(name)
                except ImportError:  # a module this interpreter lacks: the name stays unbound (a NameError)
                    pass
            continue
        if about.get("kind") == "callable":
            namespace[name] = _Proxy(solution, name)
        elif about.get("kind") == "value":
            try:
                namespace[name] = decode(about.get("value"))
            except (ValueError, TypeError, OverflowError, decimal.InvalidOperation):
                pass
        elif about.get("kind") == "module":
            # a standard-library name is always its own module for the tests (`import fractions as math`
            # in the solution does not change what `math` means in them)
            module = name if name in stdlib else about.get("module")
            if module in stdlib:
                try:
                    namespace[name] = importlib.import_module(module)
                except ImportError:
                    pass


def _describe_failure(error):
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def run_judge(config_json):
    """The judge (see the module docstring); `config_json` comes from the host."""
    config = json.loads(config_json)
    report_fd = os.dup(1)  # only the report goes there: prints of the tests go to stderr
    os.dup2(2, 1)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    except (OSError, ImportError) as e:
        sys.stderr.write("unit-test judge: cannot protect itself (%r); no tests were run\n" % (e,))
        sys.exit(3)
    total = config["total"]
    failures = []
    solution = _Solution(config["child_source"], config["code"])
    if solution.load_error is not None:
        failures.append("the solution failed to load:\n" + solution.load_error[-1500:])
    seen = {}  # assert id -> passed every time it ran

    def record(assert_id, outcome):
        passed = bool(outcome)
        seen[assert_id] = seen.get(assert_id, True) and passed
        return passed

    namespace = {"__name__": "__tests__", "__builtins__": builtins, _RECORD: record}
    completed = False
    if config["style"] == "humaneval":
        try:
            exec(compile(config["prompt"], "<prompt>", "exec"), namespace)
        except Exception:  # noqa: BLE001 - a prompt that does not run alone only lacks helpers
            pass
        entry_point = config["entry_point"]
        try:
            exec(_instrumented(config["test"], "<test>"), namespace)
            namespace[entry_point] = candidate = _Proxy(solution, entry_point)
            _bind_names(namespace, solution, [config["test"]])
            namespace["check"](candidate)
            completed = True
        except BaseException as e:  # noqa: BLE001 - a failing test is a result, not a judge failure
            failures.append(_describe_failure(e))
        if total == 1 and not seen:
            results = [completed]
        else:
            results = [seen.get(i, False) for i in range(total)]
    else:
        cases = config["cases"]
        try:
            exec(compile(config["setup"], "<test setup>", "exec"), namespace)
            _bind_names(namespace, solution, cases)
        except BaseException as e:  # noqa: BLE001 - reported; every case then fails on its own
            failures.append(_describe_failure(e))
        results = []
        for i, case in enumerate(cases):
            try:
                exec(_instrumented(case, "<test %d>" % i), namespace)
                results.append(True)
            except BaseException as e:  # noqa: BLE001 - a failing case is a result
                results.append(False)
                failures.append("%s\n  -> %s" % (case.strip(), _describe_failure(e)))
        completed = True
    solution.close()
    report = {"results": results, "completed": completed, "failures": [f[-1500:] for f in failures[:5]]}
    line = ("%s %s %s\n" % (REPORT_MARK, config["token"], json.dumps(report))).encode()
    while line:
        line = line[os.write(report_fd, line) :]
    os._exit(0)

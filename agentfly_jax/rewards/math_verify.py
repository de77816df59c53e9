"""`math_verify_match`: the final answer graded against the gold with math-verify (what TRL / open-r1 use).

math-verify parses both sides into SymPy (LaTeX or plain expressions) and compares them numerically and
symbolically: `\\frac{1}{2}` equals `0.5`, `\\{1,2\\}` equals `\\{2,1\\}`, `[1,2)` is not `[1,2]`.

Bounded time, on any thread. math-verify bounds its own parsing and comparing with `signal.alarm`, which only
works on a process's main thread; rewards here run in worker threads (`run_sync`), where math-verify's timeouts
raise instead, and with them switched off a pathological answer (`\\boxed{(10^{10^{10}})!}`) can keep SymPy busy
for ever. So the grading runs in small helper processes (`python -m agentfly_jax.rewards.math_verify`), on
their main thread with math-verify's own timeouts on, and the calling thread waits at most
`HARD_TIMEOUT_SECONDS` for the answer: a helper that overruns is killed (the chain scores 0.0 with the reason)
and the next call starts a fresh one. A helper's start (importing SymPy and math-verify: a second, or many on
a busy machine) is not part of a grading's time: a new helper first says it is ready, within
`STARTUP_TIMEOUT_SECONDS`, and only then gets its grading, so a cold start never scores a right answer 0.0.
Integer answers on both sides (every gsm_symbolic answer, most GSM8K ones) are compared in-process without
SymPy.

Nothing raises: junk, empty answers, answers over `MAX_ANSWER_CHARS`, timeouts and crashed helpers give 0.0
with the reason in the reward's extras (`reason`).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from typing import Any

from agentfly_jax.rewards.decorator import reward
from agentfly_jax.rewards.extract import extract_boxed

#: Wall-clock seconds one grading may take before its helper process is killed.
HARD_TIMEOUT_SECONDS = 10.0
#: Wall-clock seconds a new helper process may take to import math-verify and say it is ready.
STARTUP_TIMEOUT_SECONDS = 120.0
#: math-verify's own (signal-based, whole seconds) parsing and comparison timeouts inside a helper.
PARSE_TIMEOUT_SECONDS = 3
VERIFY_TIMEOUT_SECONDS = 3
#: Helper processes at most (gradings beyond that wait for a free one).
MAX_WORKERS = 4
#: Longer answers (a boxed answer, or the whole prediction when nothing is boxed) are not graded.
MAX_ANSWER_CHARS = 2000
MAX_PREDICTION_CHARS = 20000

_INTEGER = re.compile(r"[+-]?\d+")
# A math delimiter: `$` (not the escaped dollar sign `\$` of money answers), `\(`, `\[`, `\boxed`, `\fbox`.
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed|\\fbox")


class _Worker:
    """One helper process grading (gold, prediction) pairs, one JSON line each way."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agentfly_jax.rewards.math_verify"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=_repo_root(),
        )
        self._buffer = b""
        self.ready = False

    def wait_ready(self) -> None:
        """Waits for the helper's ready line; raises RuntimeError when it does not come (kill the worker)."""
        try:
            reply = self._read_line(STARTUP_TIMEOUT_SECONDS)
        except TimeoutError:
            message = f"math-verify helper did not start within {STARTUP_TIMEOUT_SECONDS:g} s"
            raise RuntimeError(message) from None
        if reply != {"ready": True}:
            raise RuntimeError(f"math-verify helper did not start: {reply!r}"[:300])
        self.ready = True

    def grade(self, request: dict, timeout: float) -> dict:
        """The helper's reply, or raises TimeoutError / RuntimeError (then the worker is unusable)."""
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        try:
            return self._read_line(timeout)
        except TimeoutError:
            raise TimeoutError(f"math-verify did not finish within {timeout:g} s") from None

    def _read_line(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"math-verify helper exited (code {self.process.poll()})")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        try:
            self.process.kill()
            self.process.wait(timeout=5)
        except Exception:  # noqa: BLE001, S110 - already gone
            pass


def _repo_root() -> str:
    # The helper imports this package; run it from the directory holding `agentfly_jax` so a source checkout
    # that is not installed works too.
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _WorkerPool:
    def __init__(self):
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_WORKERS)

    def grade(self, request: dict, timeout: float) -> dict:
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None or worker.process.poll() is not None:
                worker = _Worker()
            try:
                if not worker.ready:
                    worker.wait_ready()  # outside the grading's time limit
                reply = worker.grade(request, timeout)
            except BaseException:
                worker.kill()
                raise
            with self._lock:
                self._idle.append(worker)
            return reply

    def close(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for worker in workers:
            worker.kill()


_POOL = _WorkerPool()
atexit.register(_POOL.close)


def close_workers() -> None:
    """Stop the idle helper processes (they are also stopped at exit; the next grading starts new ones)."""
    _POOL.close()


# ------------------------------------------------------------------------------------------------- grading
def _gold_texts(answer: Any) -> list[str]:
    golds = list(answer) if isinstance(answer, (list, tuple)) else [answer]
    return [str(g).strip() for g in golds if g is not None and str(g).strip()]


#: `grade_with_math_verify` statuses: the two verdicts, and the ways of having none.
STATUS_EQUAL = "equal"
STATUS_NOT_EQUAL = "not_equal"
STATUS_UNPARSABLE = "unparsable"  # math-verify found no expression on one side (or is not installed)
STATUS_REFUSED = "refused"  # empty or too long: not graded
STATUS_FAILED = "failed"  # the helper timed out or broke


_AVAILABLE: bool | None = None


def math_verify_available() -> bool:
    """Whether the `math_verify` package is installed (the `envs` extra brings it)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = importlib.util.find_spec("math_verify") is not None
    return _AVAILABLE


def grade_with_math_verify(
    gold: Any, predicted: str, *, boxed: bool = True, timeout: float | None = None
) -> dict:
    """{"equal", "reason", "status"}: math-verify's grading of `predicted` against `gold`, and how it went.

    `status` is one of STATUS_EQUAL, STATUS_NOT_EQUAL (both sides parsed, and they differ),
    STATUS_UNPARSABLE (math-verify found nothing to compare on one side, or is not installed),
    STATUS_REFUSED (empty or too long) and STATUS_FAILED (the helper overran `timeout` or broke).
    Never raises; see `math_verify_equal`.
    """
    gold_text, predicted = str(gold).strip(), str(predicted).strip()
    if not predicted:
        return {"equal": False, "reason": "empty answer", "status": STATUS_REFUSED}
    if not gold_text:
        return {"equal": False, "reason": "empty gold answer", "status": STATUS_REFUSED}
    if len(predicted) > (MAX_ANSWER_CHARS if boxed else MAX_PREDICTION_CHARS):
        return {"equal": False, "reason": f"answer of {len(predicted)} characters is too long to grade",
                "status": STATUS_REFUSED}
    if boxed and _INTEGER.fullmatch(gold_text) and _INTEGER.fullmatch(predicted):
        equal = int(gold_text) == int(predicted)
        return {"equal": equal, "reason": None if equal else "not equal to the gold answer",
                "status": STATUS_EQUAL if equal else STATUS_NOT_EQUAL}
    if not math_verify_available():
        return {"equal": False, "reason": "math-verify is not installed (pip install math-verify)",
                "status": STATUS_UNPARSABLE}
    request = {"gold": gold_text, "prediction": predicted, "boxed": boxed}
    try:
        reply = _POOL.grade(request, HARD_TIMEOUT_SECONDS if timeout is None else timeout)
    except TimeoutError as error:
        return {"equal": False, "reason": str(error), "status": STATUS_FAILED}
    except Exception as error:  # noqa: BLE001 - a broken helper scores 0, it does not kill the rollout
        return {"equal": False, "reason": f"math-verify helper failed: {type(error).__name__}: {error}",
                "status": STATUS_FAILED}
    return {"equal": bool(reply.get("equal")), "reason": reply.get("reason"),
            "status": reply.get("status", STATUS_FAILED)}


def math_verify_equal(gold: Any, predicted: str, *, boxed: bool = True, timeout: float | None = None) -> dict:
    """{"equal": bool, "reason": str | None} of math-verify grading `predicted` against `gold`.

    `boxed`: `predicted` is the content of a `\\boxed{}` (else a whole text for math-verify to search).
    Never raises; `timeout` defaults to HARD_TIMEOUT_SECONDS.
    """
    graded = grade_with_math_verify(gold, predicted, boxed=boxed, timeout=timeout)
    return {"equal": graded["equal"], "reason": graded["reason"]}


@reward
def math_verify_match(prediction: str, answer: Any) -> dict[str, Any]:
    """1.0 when math-verify finds the final answer equal to the dataset's `answer` (a list: any of them).

    The final answer is the last `\\boxed{}` of the prediction (the chain's last assistant message); with
    none, math-verify's own extraction searches the whole text (LaTeX, then plain expressions). `answer` may
    be plain (`42`, `0.5`, `1/2`) or LaTeX (`\\boxed{42}`, `$\\frac{1}{2}$`, `[1, 2)`). Junk, timeouts and
    errors give 0.0 with `reason` in the extras.
    """
    text = prediction if isinstance(prediction, str) else ("" if prediction is None else str(prediction))
    boxed = extract_boxed(text)
    predicted, is_boxed = (boxed, True) if boxed is not None else (text, False)
    golds = _gold_texts(answer)
    if not golds:
        return {"reward": 0.0, "extracted": predicted.strip()[:100], "reason": "no gold answer"}
    reason = None
    for gold in golds:
        graded = math_verify_equal(gold, predicted, boxed=is_boxed)
        if graded["equal"]:
            return {"reward": 1.0, "extracted": predicted.strip()[:100], "reason": None}
        reason = reason or graded["reason"]
    return {"reward": 0.0, "extracted": predicted.strip()[:100], "reason": reason}


# ---------------------------------------------------------------------------------------- helper process
def _parse_gold(text: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    if _DELIMITED.search(text):
        return parse(text, configs, parsing_timeout=PARSE_TIMEOUT_SECONDS)
    # plain gold ("42", "\frac{1}{2}", "[1, 2)"): read as LaTeX math first, else as a plain expression
    return (parse(f"${text}$", configs, parsing_timeout=PARSE_TIMEOUT_SECONDS)
            or parse(text, configs, parsing_timeout=PARSE_TIMEOUT_SECONDS))


def _grade_in_helper(request: dict) -> dict:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = _parse_gold(request["gold"])
    if not gold:
        return {"equal": False, "reason": "math-verify could not parse the gold answer",
                "status": STATUS_UNPARSABLE}
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    if request["boxed"]:
        predicted = parse(f"\\boxed{{{request['prediction']}}}", configs, parsing_timeout=PARSE_TIMEOUT_SECONDS)
    else:
        predicted = parse(request["prediction"], configs, parsing_timeout=PARSE_TIMEOUT_SECONDS)
    if not predicted:
        return {"equal": False, "reason": "math-verify found no answer", "status": STATUS_UNPARSABLE}
    equal = bool(verify(gold, predicted, timeout_seconds=VERIFY_TIMEOUT_SECONDS))
    return {"equal": equal, "reason": None if equal else "not equal to the gold answer",
            "status": STATUS_EQUAL if equal else STATUS_NOT_EQUAL}


def _serve() -> None:
    """The helper's loop: one JSON request per stdin line, one JSON reply per line, until stdin closes."""
    import logging

    logging.disable(logging.WARNING)  # math-verify logs every timeout and parse failure
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # stray prints must not corrupt the replies
    import math_verify  # noqa: F401 - import once, before the first request's clock starts

    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        try:
            reply = _grade_in_helper(json.loads(line))
        except BaseException as error:  # noqa: BLE001 - including math-verify's TimeoutException
            reply = {"equal": False, "reason": f"math-verify failed: {type(error).__name__}: {error}"[:300],
                     "status": STATUS_FAILED}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve()

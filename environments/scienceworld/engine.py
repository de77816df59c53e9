"""One ScienceWorld engine (a JVM running the `scienceworld` package's simulator), with a memory cap.

The `scienceworld` package starts its JVM through py4j and offers no JVM options; the heap cap and the
garbage collector are passed through `JAVA_TOOL_OPTIONS`, which the JVM reads at start-up (measured:
≈ 230-280 MB per JVM with `-Xmx384m -XX:+UseSerialGC` instead of 600-850 MB by default).

Calls are blocking (a socket round trip to the JVM): `ScienceWorldEnv` runs them on a worker thread.
The package's own `step()` builds the ~1k-3k valid actions on every step (≈ 0.35 s); `step` here calls the
simulator's bare step (≈ 10-40 ms) and reads the score and completion from the simulator itself.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time

log = logging.getLogger(__name__)

# py4j logs every gateway start and shutdown at INFO (with tracebacks when the package's own __del__ closes an
# already closed gateway) and the package logs every task load at INFO: noise in a trainer's INFO log, one line
# per chain. Left alone where the user configured these loggers.
for _name in ("py4j", "scienceworld"):
    if logging.getLogger(_name).level == logging.NOTSET:
        logging.getLogger(_name).setLevel(logging.WARNING)

#: JVM options of every engine: a 384 MB heap and the serial collector (one core per JVM is plenty).
DEFAULT_JVM_OPTIONS = "-Xmx384m -XX:+UseSerialGC"

# JAVA_TOOL_OPTIONS is process-wide: engines start one at a time while it is set.
_LAUNCH_LOCK = threading.Lock()

#: What the simulator answers to an input it cannot parse.
INVALID_ACTION_OBSERVATION = "No known action matches that input."


class EngineCrashedError(RuntimeError):
    """The JVM behind an engine died or stopped answering."""


def _import_scienceworld():
    try:
        import scienceworld
    except ImportError as error:
        raise ImportError(
            "the ScienceWorld environment needs the `scienceworld` package (and Java 17): "
            "pip install -e '.[envs]' and bash scripts/setup_envs.sh"
        ) from error
    return scienceworld


class Engine:
    """A started ScienceWorld simulator. Not thread-safe: use it from one thread at a time."""

    def __init__(self, jvm_options: str = DEFAULT_JVM_OPTIONS):
        scienceworld = _import_scienceworld()
        started = time.perf_counter()
        with _LAUNCH_LOCK:
            previous = os.environ.get("JAVA_TOOL_OPTIONS")
            os.environ["JAVA_TOOL_OPTIONS"] = jvm_options
            try:
                self._env = scienceworld.ScienceWorldEnv("", envStepLimit=10**9)
            except Exception as error:
                raise EngineCrashedError(
                    f"could not start the ScienceWorld JVM ({type(error).__name__}: {error}); is Java 17 "
                    "installed (bash scripts/setup_envs.sh)?"
                ) from error
            finally:
                if previous is None:
                    os.environ.pop("JAVA_TOOL_OPTIONS", None)
                else:
                    os.environ["JAVA_TOOL_OPTIONS"] = previous
        self.start_s = time.perf_counter() - started
        self.server = self._env.server
        self.closed = False

    # ------------------------------------------------------------------------------------ the process
    @property
    def process(self) -> subprocess.Popen:
        return self._env._gateway.java_process

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return not self.closed and self.process.poll() is None

    def rss_bytes(self) -> int:
        """Resident memory of the JVM (0 when it is gone)."""
        try:
            with open(f"/proc/{self.pid}/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            return 0

    def close(self) -> None:
        """Shuts the gateway down and makes sure the JVM is gone; idempotent."""
        if self.closed:
            return
        self.closed = True
        process = self.process
        try:
            if process.poll() is None:
                self._env.close()
        except Exception as error:  # noqa: BLE001 - a dead JVM cannot be shut down politely
            log.debug("ScienceWorld engine %d: polite shutdown failed: %r", process.pid, error)
        finally:
            self._env._gateway.shutdown_callback_server()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=5)

    # ------------------------------------------------------------------------------------ the game
    def _call(self, what: str, function, *args):
        try:
            return function(*args)
        except Exception as error:
            if self._died(error):
                raise EngineCrashedError(
                    f"the ScienceWorld JVM (pid {self.pid}) failed during {what}: {type(error).__name__}"
                ) from error
            raise

    def _died(self, error: Exception) -> bool:
        """Whether `error` means the JVM is gone (rather than a Java exception inside a healthy JVM)."""
        if type(error).__name__ == "Py4JJavaError":
            return False
        if type(error).__name__ == "Py4JNetworkError" or isinstance(error, OSError):
            return True
        try:  # a killed JVM closes the socket a moment before the process is reaped
            self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        return not self.alive()

    def task_names(self) -> list[str]:
        return list(self._call("getTaskNames", self.server.getTaskNames))

    def load(self, task_name: str, variation: int, simplifications: str = "", gold_path: bool = False) -> None:
        self._call("load", self._env.load, task_name, variation, simplifications, gold_path)

    def variations(self, split: str) -> list[int]:
        """Variation indices of `split` ("train", "dev", "test") of the loaded task, as the package defines."""
        getter = {"train": self.server.getVariationsTrain, "dev": self.server.getVariationsDev,
                  "test": self.server.getVariationsTest}[split]
        return [int(v) for v in self._call("getVariations", getter)]

    def task_description(self) -> str:
        return str(self._call("getTaskDescription", self.server.getTaskDescription))

    def gold_actions(self) -> list[str]:
        return [str(a) for a in self._call("getGoldActionSequence", self.server.getGoldActionSequence)]

    def look(self) -> str:
        return str(self._call("look", self.server.freeActionLook))

    def step(self, action: str) -> tuple[str, float, bool, int]:
        """(observation, score in [-1, 1], completed, moves) after the simulator's bare step."""
        observation = str(self._call("step", self.server.step, action))
        score = float(self._call("getScore", self.server.getScore))
        completed = bool(self._call("getCompleted", self.server.getCompleted))
        moves = int(self._call("getNumMoves", self.server.getNumMoves))
        return observation, score, completed, moves

    def valid_actions(self) -> list[str]:
        return [str(a) for a in self._call("validActions", self.server.getValidActionObjectCombinations)]

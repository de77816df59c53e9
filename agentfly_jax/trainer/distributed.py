"""Multi-process runs: jax.distributed started from `config.distributed`, and a check that every process started
with the same config and the same code.

`start(cfg)` is what the trainer calls, before anything touches a device (agentfly-train's main, and `loop.setup`
again, which is then a no-op):

1. `initialize(cfg.distributed)` calls `jax.distributed.initialize` with the section's values. With none set it
   does so only where a cluster that JAX recognises by itself holds several processes (`detect_cluster`: an Open
   MPI job or a SLURM step of several tasks, a Cloud TPU slice of several hosts) and lets JAX fill in every value;
   anywhere else the run is one process and nothing is started. `num_processes=1` forces one process; with a
   `coordinator_address` too, jax.distributed is started as a cluster of that one process, so that its device
   collectives are those of a run of several processes (on CPU gloo's, whose sums then equal an N-process run's
   bit for bit, where the in-process all-reduce adds in another order). Set
   explicitly (all three keys), JAX's cluster detection is switched off, so a SLURM task sees every GPU of its
   node instead of the one JAX would pick for it. A process other than 0 first waits for the coordinator's port
   to open and says so in one line if it never does (JAX's client would abort the process without a Python
   exception); a process that waits in vain for the others to connect is still ended by JAX itself.
2. `check_same_everywhere(cfg)`: every process publishes its `config_digest`, `code_digest` and library versions
   in the key-value store of jax.distributed's coordinator (no device is involved) and reads everyone's. If any
   process differs from process 0, EVERY process raises ProcessMismatchError, one line naming what differs: the
   config keys with their values, the code files, the versions, and which processes. Without the check, processes
   that disagree fail much later, at a collective that hangs or a shape that does not match, or train silently
   on different settings.

3. `watch(cfg)`: from then on a watchdog (`Watchdog`) in each process publishes heartbeats in the same store and
   reads everyone's, so that a process that dies, freezes or fails stops every other one within about
   2 x config.distributed.heartbeat_timeout, with one line naming it (ProcessLostError) and saying how to resume,
   instead of leaving them blocked in a collective or an exchange (docs/tpu.md "When a process fails"). The
   trainer's loop reports its own errors to the others (`stopped_by`).

Fields that may legitimately differ between processes are left out of the config digest (`PER_PROCESS_FIELDS`):
- `distributed`: process_id differs by definition; coordinator_address may be spelt differently on the
  coordinator's own host; auto-detected and explicit values describe the same run. That the processes agree on
  the coordinator and on their number is what jax.distributed checks when they connect.
- `progress`: a progress bar changes no computation.
Everything else must be equal, `workdir` included: the checkpoints of one run are written to one shared place.

The code digest covers the `.py` files of the agentfly_jax package that is imported (this checkout when installed
editable), keyed by their path inside the package; environment plugins outside it are not covered.
"""
from __future__ import annotations

import _thread
import atexit
import dataclasses
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

PER_PROCESS_FIELDS = ("distributed", "progress")
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
_KV_PREFIX = "agentfly_jax/start"
_MAX_NAMED = 5  # config keys / files / processes named in one error line


class DistributedError(RuntimeError):
    """The processes of a run could not be started together; the message says what to check."""


class ProcessMismatchError(DistributedError):
    """Processes of one run started with different configs, code or library versions."""


# ============================================================================================== digests
def _canonical_config(cfg) -> dict:
    values = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)
    return {k: v for k, v in values.items() if k not in PER_PROCESS_FIELDS}


def _json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def config_digest(cfg) -> str:
    """sha256 of the config (a TrainConfig, or its asdict) without `PER_PROCESS_FIELDS`, as canonical JSON (keys
    sorted, tuples as lists): equal configs give equal digests in any process, on any host."""
    return hashlib.sha256(_json(_canonical_config(cfg)).encode()).hexdigest()


def config_values(cfg) -> dict[str, str]:
    """The config's leaves without `PER_PROCESS_FIELDS`, as {"section.key": JSON of the value}: what two configs
    of different digests are compared by to name the keys that differ."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value):
        if isinstance(value, Mapping) and value:
            for k in sorted(value, key=str):
                walk(f"{prefix}.{k}" if prefix else str(k), value[k])
        else:
            flat[prefix] = _json(value)

    walk("", _canonical_config(cfg))
    return flat


def package_root() -> str:
    """The directory of the imported agentfly_jax package."""
    import agentfly_jax

    return os.path.dirname(os.path.abspath(agentfly_jax.__file__))


def code_files(root: str | None = None) -> dict[str, str]:
    """{path inside the package (with the package name, '/'-separated): sha256 of the file} for every .py file of
    the agentfly_jax package at `root` (default: the imported one); caches (__pycache__) are not code."""
    root = os.path.abspath(root or package_root())
    name = os.path.basename(root)
    files = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for fname in names:
            if fname.endswith(".py"):
                path = os.path.join(folder, fname)
                rel = "/".join([name, *os.path.relpath(path, root).split(os.sep)])
                with open(path, "rb") as fh:
                    files[rel] = hashlib.sha256(fh.read()).hexdigest()
    return dict(sorted(files.items()))


def code_digest(root: str | None = None, files: Mapping[str, str] | None = None) -> str:
    """sha256 over the package's .py files (`code_files`): their paths and contents, in path order."""
    files = code_files(root) if files is None else files
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]}\n".encode())
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    """Python's (major.minor) and JAX's versions: processes with different ones may compile different programs."""
    import jax
    import jaxlib

    return {"python": "{}.{}".format(*sys.version_info[:2]), "jax": jax.__version__, "jaxlib": jaxlib.__version__}


# ============================================================================================ comparison
def _processes(ids: list[int]) -> str:
    named = ", ".join(str(i) for i in ids[:_MAX_NAMED])
    more = f" and {len(ids) - _MAX_NAMED} more" if len(ids) > _MAX_NAMED else ""
    return f"process{'es' if len(ids) > 1 else ''} {named}{more}"


def _differences(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def describe_mismatch(digests: list[Mapping[str, Any]], details: Callable[[int], Mapping[str, Any]]) -> str | None:
    """None when every process's digests equal process 0's; else one line naming what differs.

    `digests[i]` is process i's {"config": config_digest, "code": code_digest, "versions": library_versions()};
    `details(i)` gives process i's {"config": config_values, "code": code_files}, asked only of process 0 and the
    first process that differs (it is read from the coordinator)."""
    parts = []
    first = digests[0]
    for kind in ("config", "code"):
        others = [i for i, d in enumerate(digests) if d[kind] != first[kind]]
        if not others:
            continue
        p = others[0]
        keys = _differences(details(0)[kind], details(p)[kind])
        shown = keys[:_MAX_NAMED] + (["..."] if len(keys) > _MAX_NAMED else [])
        if kind == "config":
            d0, dp = details(0)["config"], details(p)["config"]
            what = ", ".join(k if k == "..." else f"{k}: {d0.get(k, '(absent)')} on process 0, "
                             f"{dp.get(k, '(absent)')} on process {p}" for k in shown)
            parts.append(f"config digest differs: {_processes(others)} started with another config than process 0 "
                         f"({what}); start every process with the same experiment file and --config overrides")
        else:
            parts.append(f"code digest differs: {_processes(others)} {'run' if len(others) > 1 else 'runs'} other "
                         f"agentfly_jax code than process 0 (files that differ between process 0 and process {p}: "
                         f"{', '.join(shown)}); install the same commit on every host (scripts/tpu/setup.sh copies "
                         "one checkout to every TPU worker)")
    others = [i for i, d in enumerate(digests) if d["versions"] != first["versions"]]
    if others:
        p = others[0]
        names = _differences(first["versions"], digests[p]["versions"])
        what = ", ".join(f"{n} {first['versions'].get(n)} on process 0, {digests[p]['versions'].get(n)} on process "
                         f"{p}" for n in names)
        parts.append(f"library versions differ on {_processes(others)} ({what}); install the same packages "
                     "on every host")
    if not parts:
        return None
    return f"the {len(digests)} processes of this run did not start the same: " + "; ".join(parts)


# ======================================================================================== initialisation
@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster that jax.distributed.initialize() recognises by itself."""

    kind: str  # "openmpi" | "slurm" | "tpu"
    num_processes: int | None  # None: known to JAX only (it asks the TPU metadata server)


def detect_cluster(environ: Mapping[str, str] | None = None) -> Cluster | None:
    """The cluster this process runs in, checked in the order JAX checks them: an Open MPI job (mpirun's
    variables), a SLURM step (srun's variables: job, step nodes, tasks, task id and local id), a Cloud TPU VM (its
    slice's worker count from JAX's TPU cluster classes). None elsewhere (a plain machine, a SLURM allocation
    outside srun, a Kubernetes pod: those set the keys explicitly)."""
    env = os.environ if environ is None else environ
    if "OMPI_MCA_orte_hnp_uri" in env:
        size = env.get("OMPI_COMM_WORLD_SIZE", "")
        return Cluster("openmpi", int(size) if size.isdigit() else None)
    if all(v in env for v in _SLURM_VARS):
        return Cluster("slurm", int(env["SLURM_NTASKS"]))
    if environ is None and _on_cloud_tpu_vm():
        return Cluster("tpu", _tpu_process_count())
    return None


def _on_cloud_tpu_vm() -> bool:
    import jax  # noqa: F401  (importing jax runs its Cloud TPU detection: TPU chips on the PCI bus)
    from jax._src import cloud_tpu_init

    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def _tpu_process_count() -> int | None:
    """The hosts of this TPU slice (times its slices) as JAX's cluster classes count them; None when they cannot
    tell (JAX then decides at initialize)."""
    try:
        from jax._src import clusters

        for env in (clusters.GkeTpuCluster, clusters.GceTpuCluster):
            if env.is_env_present():
                return int(env.get_process_count())
    except Exception as e:  # noqa: BLE001 (JAX internals or the metadata server; initialize() asks again)
        log.warning("could not count the hosts of this TPU slice (%s): jax.distributed decides", e)
    return None


def _runtime():
    """jax.distributed's process state (coordinator client, process id, process count), read without starting
    any device backend, which jax.process_count() would do."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Waits until process 0's coordinator accepts TCP connections at `address`; DistributedError after
    `timeout_s`. JAX's own client aborts the whole process (a C++ check failure, no Python exception) when it
    cannot connect in time, so an unreachable coordinator is reported here instead, in one line."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, max(timeout_s, 0.1))):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise DistributedError(f"config.distributed.coordinator_address={address!r} accepted no connection within "
                                   f"{timeout_s} s (config.distributed.initialization_timeout; last error: {last}): "
                                   "start process 0 too, and use an address of its host that this host can reach")
        time.sleep(0.25)


def initialize(section) -> bool:
    """Starts jax.distributed as `section` (config.distributed) says; True when this run has several processes.
    Idempotent: once started (here or by the caller's own jax.distributed.initialize), it only checks that
    explicit values agree with the running system. Must come before anything touches a device."""
    import jax

    explicit = {"coordinator_address": section.coordinator_address or None,
                "num_processes": section.num_processes, "process_id": section.process_id}
    if jax.distributed.is_initialized():
        state = _runtime()
        running = {"num_processes": state.num_processes, "process_id": state.process_id}
        for key, value in running.items():
            if explicit[key] is not None and explicit[key] != value:
                raise DistributedError(f"config.distributed.{key}={explicit[key]} but jax.distributed already runs "
                                       f"with {key}={value}: unset the key or start the process with that value")
        return state.num_processes > 1
    given = {k: v for k, v in explicit.items() if v is not None}
    if section.num_processes == 1:
        if not given.get("coordinator_address"):
            return False  # one process, nothing started
        given.setdefault("process_id", 0)  # (config refuses any other id for one process)
    cluster = None
    if len(given) < 3:
        cluster = detect_cluster()
        if not given and (cluster is None or cluster.num_processes == 1):
            return False  # one process
        if cluster is None and not (set(given) == {"num_processes", "process_id"}
                                    and os.environ.get("JAX_COORDINATOR_ADDRESS")):
            missing = ", ".join(f"config.distributed.{k}" for k in explicit if k not in given)
            raise DistributedError(f"config.distributed sets {', '.join(sorted(given))} but no cluster that JAX "
                                   f"detects (Cloud TPU slice, SLURM step, Open MPI job) supplies {missing}: set "
                                   "coordinator_address, num_processes and process_id on every process")
    # JAX's own heartbeat ends every process with a fatal abort (no cleanup, no Python exception) when one is lost:
    # it is set well past the watchdog's (`Watchdog`), which stops the processes first and cleanly
    kwargs = dict(given, initialization_timeout=section.initialization_timeout,
                  heartbeat_timeout_seconds=jax_heartbeat_timeout(section.heartbeat_timeout))
    if len(given) == 3:
        kwargs["cluster_detection_method"] = "deactivate"  # every value given: no detection, all local devices
    where = f"{cluster.kind} cluster, " if cluster is not None else ""
    call = ", ".join(f"{k}={v!r}" for k, v in given.items()) or "values auto-detected"
    if given.get("coordinator_address") and given.get("process_id", 0) != 0:
        _wait_for_coordinator(given["coordinator_address"], section.initialization_timeout)
    log.info("jax.distributed: starting (%s%s); waiting up to %d s for every process to connect", where, call,
             section.initialization_timeout)
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:  # JAX raises ValueError, RuntimeError or its own errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = ("start the distributed system before any JAX computation (agentfly-train does it first)"
                if "must be called before" in str(e) else
                "check that process 0 runs, that its coordinator_address is reachable from this host, and that "
                f"every process started within config.distributed.initialization_timeout="
                f"{section.initialization_timeout} s")
        raise DistributedError(f"jax.distributed.initialize ({where}{call}) failed: {first}; {hint}") from e
    state = _runtime()
    log.info("jax.distributed: process %d of %d (coordinator %s)", state.process_id, state.num_processes,
             state.coordinator_address)
    return state.num_processes > 1


# ========================================================================================== the check
_rounds = {"count": 0, "checked": None}


def check_same_everywhere(cfg, timeout_s: float | None = None) -> None:
    """Every process of the running jax.distributed system compares its config digest, code digest and library
    versions with every other's through the coordinator's key-value store; ProcessMismatchError on EVERY process
    when any differs (`describe_mismatch`), DistributedError when a process does not publish within `timeout_s`
    (default config.distributed.initialization_timeout). Collective: all processes call it, in the same order."""
    state = _runtime()
    client, me, n = state.client, state.process_id, state.num_processes
    if client is None:
        raise DistributedError("check_same_everywhere needs jax.distributed to be running (start(cfg) starts it)")
    timeout_s = cfg.distributed.initialization_timeout if timeout_s is None else timeout_s
    _rounds["count"] += 1  # every process counts its calls alike: a new call never reads an older call's keys
    base = f"{_KV_PREFIX}/{_rounds['count']}"
    files = code_files()
    mine = {"config": config_digest(cfg), "code": code_digest(files=files), "versions": library_versions()}
    client.key_value_set(f"{base}/digests/{me}", _json(mine))
    client.key_value_set(f"{base}/details/{me}", _json({"config": config_values(cfg), "code": files}))

    def get(kind: str, i: int) -> dict:
        if kind == "digests" and i == me:
            return mine
        try:
            return json.loads(client.blocking_key_value_get(f"{base}/{kind}/{i}", int(timeout_s * 1000)))
        except Exception as e:  # a deadline or a coordinator gone: JAX's runtime error
            raise DistributedError(f"process {i} of {n} did not publish its config/code digests within {timeout_s} "
                                   "s (config.distributed.initialization_timeout): it failed or hangs before this "
                                   f"point, see its log ({str(e).strip().splitlines()[0] if str(e).strip() else e})"
                                   ) from e

    details: dict[int, dict] = {}
    message = describe_mismatch([get("digests", i) for i in range(n)],
                                lambda i: details.setdefault(i, get("details", i)))
    if message:
        raise ProcessMismatchError(f"{message} (this is process {me})")
    log.info("process %d of %d: config %s, code %s: the same on every process", me, n, mine["config"][:12],
             mine["code"][:12])


def start(cfg) -> bool:
    """`initialize(cfg.distributed)`, then, with several processes, `check_same_everywhere(cfg)` and `watch(cfg)`;
    True when this run has several processes. Idempotent: a second call with the same config does nothing; with another config
    (a program that trains twice) the processes compare again."""
    if not initialize(cfg.distributed):
        return False
    digest = config_digest(cfg)
    if _rounds["checked"] != digest:
        check_same_everywhere(cfg)
        _rounds["checked"] = digest
    watch(cfg)
    return True


# ============================================================================= host-level exchange between processes
#: How long `allgather_json` waits for a process's value (another process may still be rolling out its share).
EXCHANGE_TIMEOUT_S = 3600.0
_exchanges = {"count": 0}


def process_share(count: int, index: int | None = None, processes: int | None = None) -> slice:
    """The contiguous share of `count` items (a step's tasks, the held-out tasks) that process `index` of
    `processes` (default: this process of the running system) takes: disjoint, deterministic, in order (the
    shares of processes 0, 1, ... concatenated are the items), sizes differing by at most one."""
    if index is None or processes is None:
        state = _runtime()
        index = state.process_id if index is None else index
        processes = (state.num_processes or 1) if processes is None else processes
    index, processes = int(index or 0), int(processes or 1)
    return slice(index * count // processes, (index + 1) * count // processes)


def allgather_json(value: Any, timeout_s: float | None = None) -> list:
    """Every process's `value` (JSON-able: numbers, strings, lists, dicts), in process order, through the
    coordinator's key-value store: host data only, no device work and nothing to compile. One process: [value].
    Collective: every process calls it the same number of times, in the same order. A process that does not
    publish within `timeout_s` (default config.distributed.exchange_timeout, EXCHANGE_TIMEOUT_S before `start`)
    is named in a DistributedError; a process lost meanwhile (the watchdog's verdict) ends the wait at once with a
    ProcessLostError."""
    state = _runtime()
    client, me, n = state.client, state.process_id, state.num_processes
    if client is None or not n or n == 1:
        return [value]
    timeout_s = _watch["exchange_timeout"] if timeout_s is None else timeout_s
    _exchanges["count"] += 1
    count = _exchanges["count"]
    base = f"{_KV_PREFIX}/exchange"
    mine = _json(value)
    client.key_value_set(f"{base}/{count}/{me}", mine)
    out = []
    for i in range(n):
        if i == me:
            out.append(json.loads(mine))
            continue
        out.append(json.loads(_wait_for(client, f"{base}/{count}/{i}", timeout_s, lambda e, i=i: DistributedError(
            f"process {i} of {n} did not publish its share of exchange {count} within {timeout_s:.0f} s "
            "(config.distributed.exchange_timeout) although it still sends heartbeats: it hangs in its own code "
            "(an environment, a tool, a reward: see its log) or its share of the step takes longer than that "
            f"(raise the timeout) ({e})"))))
    # every process has read every value of exchange count - 1 before it published this one, so the values of
    # count - 2 are read everywhere: this process's can go (the store would otherwise grow every step)
    if count > 2:
        try:
            client.key_value_delete(f"{base}/{count - 2}/{me}")
        except Exception as e:  # noqa: BLE001 - a value left in the store costs memory, not correctness
            log.debug("could not delete exchange %d's value: %s", count - 2, e)
    return out


def _first_line(e: BaseException | str) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _wait_for(client, key: str, timeout_s: float, timed_out: Callable[[str], Exception]) -> str:
    """The value of `key` once some process sets it; `timed_out(last error)` raised after `timeout_s`. With the
    watchdog running the wait is cut into one-second gets (each gives the GIL back, none holds a deadline that
    matters), so that a lost process's verdict ends it within a second (ProcessLostError), and an error of the
    store itself (the coordinator gone) is raised as an ExchangeError."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    dog = _watch["dog"]
    if dog is None:
        try:
            return client.blocking_key_value_get(key, max(1, int(1000 * timeout_s)))
        except Exception as e:  # a deadline or a coordinator gone: JAX's runtime error
            raise timed_out(_first_line(e)) from e
    dog.waiting = True  # the watchdog need not interrupt this thread: the wait looks at its verdict every second
    try:
        while not dog.failure:
            left = deadline - time.monotonic()
            if left <= 0:
                raise timed_out(last)
            try:
                return client.blocking_key_value_get(key, max(1, int(1000 * min(left, 1.0))))
            except Exception as e:  # JAX's runtime error: a deadline (go on waiting) or the store's own failure
                last = _first_line(e)
                if "DEADLINE_EXCEEDED" not in last:
                    raise ExchangeError(f"the coordinator's key-value store failed while waiting for {key!r}: "
                                        f"{last}") from e
    finally:
        dog.waiting = False
        if dog.failure:  # a verdict that came as the wait ended was not sent as an interrupt: raised here
            raise ProcessLostError(dog.failure) from None
    raise ProcessLostError(dog.failure)  # not reached (the finally raises); for the reader


# ======================================================================================= when a process fails
class ProcessLostError(DistributedError):
    """Another process of this run died, froze, stopped answering or failed, so this one stopped too; the message
    names that process and says how to continue (every process restarted with resume=True)."""


class ExchangeError(DistributedError):
    """The coordinator's key-value store failed under a host exchange (its process is gone, most likely)."""


#: Keys of the watchdog in the coordinator's store: alive/<p> (a counter), failed/<p> (a reason), done/<p>.
_WATCH_PREFIX = "agentfly_jax/watch"
#: The longest the callbacks of `at_emergency_exit` get when the watchdog ends a stuck process.
EMERGENCY_CLEANUP_S = 15.0
_watch: dict[str, Any] = {"dog": None, "exchange_timeout": EXCHANGE_TIMEOUT_S, "atexit": False,
                          "interrupt_signal": None}


def jax_heartbeat_timeout(heartbeat_timeout: float) -> int:
    """The heartbeat timeout given to jax.distributed: past the watchdog's verdict (`heartbeat_timeout`) and the
    `heartbeat_timeout` a stuck process then gets before it is ended, so that JAX's own reaction to a lost
    process (a fatal abort of every other process: no cleanup, no message of ours) never comes first."""
    return int(3 * heartbeat_timeout + 60)


#: how long a process ending on a failure waits for the store to confirm that it said so (Watchdog.exiting)
EXITED_WAIT_S = 1.0
#: how long process 0 stays after the others said they are exiting on a failure: longer than each of them may
#: still wait for that confirmation before it exits
EXIT_LINGER_S = EXITED_WAIT_S + 2.0


class Watchdog:
    """Watches the other processes of a run through the coordinator's key-value store, so that a process that dies,
    freezes or fails stops every other one within a bounded time, with one line naming it (`failure`), instead of
    leaving them blocked in a collective or an exchange that never completes.

    Two daemon threads. `pulse` publishes this process's heartbeat (a counter) every `interval` s and reads every
    process's heartbeat, failure and normal end (two small RPCs). `check` decides from what `pulse` last read and
    never calls the store itself (a call to a frozen coordinator blocks): a process whose counter has not moved for
    `timeout` s of this process's contact with the store is lost (it died: killed, out of memory, its host gone;
    or it is frozen); a process that published a failure (`fail`) has failed; no answer from the store for
    `timeout` s means the coordinator's process (0) is lost. On a verdict `check` logs it, interrupts the main
    thread (KeyboardInterrupt at its next Python instruction; an asyncio rollout is cancelled cleanly) unless the
    main thread is already stopping on an error of its own, and gives the process `grace` s to end; a process
    still running then (its main thread stuck inside a device collective that waits for the lost process) is
    ended: the `at_emergency_exit` callbacks (at most EMERGENCY_CLEANUP_S), its child processes terminated, exit
    status 1."""

    def __init__(self, client, me: int, n: int, timeout: float, *, grace: float | None = None,
                 coordinator: str = "", workdir: str = ""):
        self.client, self.me, self.n = client, me, n
        self.timeout = float(timeout)
        self.grace = self.timeout if grace is None else float(grace)
        self.interval = min(5.0, max(0.1, self.timeout / 10))
        self.coordinator, self.workdir = coordinator, workdir
        self.failure: str | None = None  # the verdict: why this process must stop
        self.handling = False  # the main thread stops on an error it raised: not interrupted
        self.waiting = False  # the main thread waits in an exchange, which looks at `failure`: not interrupted
        self.failed_here = False  # this process failed and told the others
        self.emergency: dict[int, Callable[[], Any]] = {}
        self._lock = threading.Lock()
        now = time.monotonic()
        self._contact, self._contact_error = now, ""
        self._beats: dict[int, tuple[str | None, float]] = {i: (None, now) for i in range(n) if i != me}
        self._failed: dict[int, str] = {}
        self._done: set[int] = set()
        self._exited: set[int] = set()  # processes that stopped on a failure and end now
        self._deadline = float("inf")
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._pulse, name="agentfly-watchdog-pulse", daemon=True),
                         threading.Thread(target=self._check, name="agentfly-watchdog-check", daemon=True)]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------------------------------- the threads
    def _pulse(self) -> None:
        beat = 0
        while not self._stop.is_set():
            beat += 1
            try:
                self.client.key_value_set(f"{_WATCH_PREFIX}/alive/{self.me}", str(beat), allow_overwrite=True)
                entries = self.client.key_value_dir_get(f"{_WATCH_PREFIX}/")
            except Exception as e:  # noqa: BLE001 - the coordinator is unreachable: `check` judges how long
                self._contact_error = _first_line(e)
            else:
                now = time.monotonic()
                with self._lock:
                    self._contact = now
                    for key, value in entries:
                        kind, _, who = key[len(_WATCH_PREFIX) + 1:].rpartition("/")
                        if not who.isdigit() or int(who) == self.me or int(who) >= self.n:
                            continue
                        i = int(who)
                        if kind == "alive" and value != self._beats[i][0]:
                            self._beats[i] = (value, now)
                        elif kind == "failed":
                            self._failed.setdefault(i, value)
                        elif kind == "done":
                            self._done.add(i)
                        elif kind == "exited":
                            self._exited.add(i)
            self._stop.wait(self.interval)

    def _check(self) -> None:
        while not self._stop.wait(self.interval / 2):
            if self.failure is None:
                verdict = self.verdict(time.monotonic())
                if verdict:
                    self._stop_for(verdict)
            elif time.monotonic() >= self._deadline:
                self._end_now()

    def verdict(self, now: float) -> str | None:
        """Why this process must stop, from what `pulse` last read; None while every process is well."""
        with self._lock:
            failed, done, contact = dict(self._failed), set(self._done), self._contact
            beats = {i: t for i, (_, t) in self._beats.items() if i not in done}
        n, timeout = self.n, self.timeout
        if failed:
            i = min(failed)
            return (f"process {i} of {n} failed: {failed[i]} (see its log); every process of this run stops. "
                    f"{self._resume_hint()}")
        if now - contact > timeout:
            return (f"no answer from the coordinator (process 0 at {self.coordinator or 'its address'}) for "
                    f"{now - contact:.0f} s (config.distributed.heartbeat_timeout={timeout:g}; last error: "
                    f"{self._contact_error or 'none, a call is still waiting'}): process 0 died (killed, out of "
                    f"memory, its host gone) or froze, or the network to its host is down; every process of this "
                    f"run stops. {self._resume_hint()}")
        stale = sorted((t, i) for i, t in beats.items() if contact - t > timeout)
        if stale:
            t, i = stale[0]
            return (f"process {i} of {n} sent no heartbeat for {contact - t:.0f} s (config.distributed."
                    f"heartbeat_timeout={timeout:g}): it died (killed, out of memory, its host gone) or froze, see "
                    f"its log; every process of this run stops. {self._resume_hint()}")
        return None

    def _resume_hint(self) -> str:
        where = f" in {os.path.join(self.workdir, 'checkpoints')}" if self.workdir else ""
        return (f"Restart all {self.n} processes with the same command and --config.resume=True to continue from the "
                f"last checkpoint{where} (this is process {self.me})")

    def _stop_for(self, verdict: str) -> None:
        self.failure = verdict  # set before `waiting` is read (an exchange clears `waiting`, then reads this)
        self._deadline = time.monotonic() + self.grace
        log.error("%s", verdict)
        if not (self.handling or self.waiting):
            _interrupt_main()

    def _end_now(self) -> None:
        """The grace is over and the process still runs: its main thread is stuck (a device collective waiting for
        the lost process never returns). Ends the process, its children first."""
        self._stop.set()
        log.error("this process still runs %.0f s after it stopped for another process (its main thread is stuck, "
                  "e.g. in a device collective that waits for the lost process): ending it", self.grace)
        callbacks = list(self.emergency.values())

        def run_all():
            for fn in callbacks:
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - every callback gets its turn
                    log.error("cleanup before ending the process: %s: %s", type(e).__name__, e)

        helper = threading.Thread(target=run_all, name="agentfly-emergency-cleanup", daemon=True)
        helper.start()
        helper.join(EMERGENCY_CLEANUP_S)
        end_child_processes()
        _flush_output()
        self._publish("exited", "1", wait=EXITED_WAIT_S)  # process 0 need not wait out its own grace for this one
        _exit(1)

    # ------------------------------------------------------------------------------------ the main thread's
    def fail(self, reason: str) -> None:
        """Tells the other processes that this one failed (`reason`, one line): they stop at once with it."""
        self.failed_here = True
        self._publish("failed", reason[:500])

    def _publish(self, kind: str, value: str, wait: float | None = None) -> None:
        """Sets `kind`/<this process> in the store; waits at most `wait` s (default min(5, timeout)) for the
        store's answer (a frozen coordinator would hold the call)."""
        done = threading.Event()

        def publish():
            try:
                self.client.key_value_set(f"{_WATCH_PREFIX}/{kind}/{self.me}", value, allow_overwrite=True)
            except Exception as e:  # noqa: BLE001 - the others then find out by their own timeouts
                log.error("could not tell the other processes (%s): %s", kind, _first_line(e))
            done.set()

        threading.Thread(target=publish, name=f"agentfly-watchdog-{kind}", daemon=True).start()
        done.wait(min(5.0, self.timeout) if wait is None else wait)

    def exiting(self) -> None:
        """This process ends on a failure, its cleanup done. Process 0 then waits until every other process that
        is not lost ends too (at most as long as another can still run: its `grace` after it learns of the failure,
        when its own watchdog ends it, which says so too): its coordinator going away would make JAX abort them
        at once, in the middle of their own cleanup. A process says so as its last step, waiting at most EXITED_WAIT_S
        for the store's answer; process 0 then stays EXIT_LINGER_S longer, so that the others' last steps are
        not cut short by the coordinator's end. (Process 0 used to wait its own grace from its own end: a process
        that slept through its interrupt, SIGINT being ignored in a suite run in the background, was ended by its
        grace just after process 0 had left, and JAX aborted it first; seen in three suite runs.)"""
        self._publish("exited", "1", wait=EXITED_WAIT_S)
        if self.me == 0:
            # as long as any other process can still run: each learns of the failure within about two heartbeats
            # and is ended by its own watchdog `grace` s after that (`_end_now`) if it has not ended by itself
            start, wait_s = time.monotonic(), self.grace + 2 * self.interval + EXIT_LINGER_S
            waiting = set(self._beats)
            while time.monotonic() - start < wait_s:
                with self._lock:
                    lost = {i for i, (_, t) in self._beats.items() if self._contact - t > self.timeout}
                    waiting = set(self._beats) - lost - self._exited - self._done
                    exited = sorted(self._exited)
                if not waiting:
                    log.debug("process 0 ends on a failure: %.1f s after it said so, processes %s had ended too "
                              "(%s lost); it stays %.0f s more", time.monotonic() - start, exited,
                              sorted(lost) or "none", EXIT_LINGER_S if exited else 0)
                    if exited:
                        time.sleep(EXIT_LINGER_S)
                    break
                time.sleep(self.interval / 2)
            if waiting:
                log.warning("process 0 ends on a failure while processes %s still run %.0f s after it said so "
                            "(config.distributed.heartbeat_timeout): its coordinator's end makes JAX abort them",
                            sorted(waiting), wait_s)
        self.close()

    def finish(self) -> None:
        """This process ends normally: the others stop watching it (JAX's shutdown then waits for everyone)."""
        self._stop.set()
        self._publish("done", "1")

    def close(self) -> None:
        self._stop.set()


def watch(cfg) -> Watchdog | None:
    """Starts the watchdog of this process (once; a later call only takes the new exchange_timeout) when the run has
    several processes; None with one. Called by `start`."""
    state = _runtime()
    section = cfg.distributed
    if state.client is None or (state.num_processes or 1) == 1:
        return None
    _watch["exchange_timeout"] = float(section.exchange_timeout)
    if _watch["dog"] is None:
        _watch["interrupt_signal"] = _choose_interrupt_signal()
        _watch["dog"] = Watchdog(state.client, state.process_id, state.num_processes, section.heartbeat_timeout,
                                 coordinator=state.coordinator_address or "", workdir=cfg.workdir)
        if not _watch["atexit"]:  # registered after jax's own exit handler, so it runs before it
            atexit.register(_at_exit)
            _watch["atexit"] = True
        log.info("process %d of %d watches the others: heartbeat every %.1f s, a process silent for %d s is lost "
                 "(config.distributed.heartbeat_timeout)", state.process_id, state.num_processes,
                 _watch["dog"].interval, section.heartbeat_timeout)
    return _watch["dog"]


def stopped_by(exc: BaseException) -> ProcessLostError | None:
    """For the trainer, with the exception that ends its run. With one process: None. Otherwise, when another
    process was lost or failed, the ProcessLostError to raise instead (waiting up to heartbeat_timeout for the
    watchdog's verdict when `exc` may be that loss seen from here: a runtime error of the devices, which a
    collective raises when its peer's connection breaks, or of the coordinator's store). Else `exc` is this
    process's own failure: the others are told its one-line reason (they stop at once) and None is returned."""
    dog = _watch["dog"]
    if dog is None:
        return None
    dog.handling = True
    if isinstance(exc, ProcessLostError):  # the verdict itself, raised by an exchange
        return None
    if dog.failure is None and _may_be_a_lost_process(exc):
        deadline = time.monotonic() + dog.timeout + 2 * dog.interval
        while dog.failure is None and time.monotonic() < deadline:
            try:
                time.sleep(dog.interval / 2)
            except KeyboardInterrupt:  # the watchdog's interrupt, sent before it saw `handling`
                pass
    if dog.failure is not None:
        return ProcessLostError(dog.failure)
    reason = "KeyboardInterrupt (Ctrl-C or SIGINT)" if isinstance(exc, KeyboardInterrupt) else \
        f"{type(exc).__name__}: {_first_line(exc)}"
    dog.fail(reason)
    return None


#: How the runtime's errors begin (an XLA status code): a collective whose peer is gone fails with one of them
#: (gloo: "UNKNOWN: Gloo AllGather failed: ... Connection closed by peer", raised as a ValueError).
_RUNTIME_STATUS = ("UNKNOWN:", "UNAVAILABLE:", "INTERNAL:", "ABORTED:", "CANCELLED:", "DEADLINE_EXCEEDED:",
                   "FAILED_PRECONDITION:", "DATA_LOSS:")


def _may_be_a_lost_process(exc: BaseException) -> bool:
    """Whether `exc` may be another process's loss seen from this one: an error of the coordinator's store, or
    of the runtime (a device collective)."""
    if isinstance(exc, ExchangeError) or str(exc).lstrip().startswith(_RUNTIME_STATUS):
        return True
    try:
        from jax.errors import JaxRuntimeError
    except ImportError:  # pragma: no cover - older JAX
        return False
    return isinstance(exc, JaxRuntimeError)


def at_emergency_exit(fn: Callable[[], Any]) -> Callable[[], None]:
    """Registers `fn` (e.g. closing environment pools and launched servers) to run if the watchdog has to end this
    process while its main thread is stuck; returns the function that unregisters it. No-op with one process."""
    dog = _watch["dog"]
    if dog is None:
        return lambda: None
    key = id(fn)
    dog.emergency[key] = fn
    return lambda: dog.emergency.pop(key, None)


def end_child_processes(grace_s: float = 2.0) -> list[int]:
    """Terminates every descendant process of this one (environment servers, sandboxes, launched inference
    servers; those that lead a process group with their group): SIGTERM, SIGKILL after `grace_s` for any still
    there. Linux (/proc); elsewhere nothing. The pids signalled."""
    pids = _descendants(os.getpid())
    own_group = os.getpgrp()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                if os.getpgid(pid) == pid and pid != own_group:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
            except OSError:  # already gone
                pass
        if sig == signal.SIGTERM:
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.05)
    return pids


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"  # a zombie is gone (its parent reaps it)
    except OSError:
        return False


def _raise_keyboard_interrupt(signum, frame):  # noqa: ARG001 - a signal handler's signature
    raise KeyboardInterrupt


def _choose_interrupt_signal() -> int | None:
    """The signal `_interrupt_main` sends, chosen in the main thread when the watchdog starts: SIGINT where Python
    handles it (its KeyboardInterrupt; asyncio's own handler cancels a rollout cleanly); else, where SIGINT is
    ignored (a process started in the background by a non-interactive shell, `cmd &`, inherits that, and Python
    then leaves it ignored) or left to its default action, SIGUSR1 with a handler that raises KeyboardInterrupt, if
    nothing else has claimed SIGUSR1; else None (the flag only)."""
    if threading.current_thread() is not threading.main_thread():
        return signal.SIGINT if callable(signal.getsignal(signal.SIGINT)) else None
    if callable(signal.getsignal(signal.SIGINT)):
        return signal.SIGINT
    if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, _raise_keyboard_interrupt):
        signal.signal(signal.SIGUSR1, _raise_keyboard_interrupt)
        return signal.SIGUSR1
    log.warning("SIGINT is not Python's to handle here and SIGUSR1 has another handler: a process told to stop "
                "while blocked (a sleep, a socket read) ends only after config.distributed.heartbeat_timeout")
    return None


def _interrupt_main() -> None:
    """A KeyboardInterrupt in the main thread, even in a blocking call (sleep, a socket read: the signal interrupts
    it) that _thread.interrupt_main alone would wait out: the signal `_choose_interrupt_signal` chose. Without one,
    the flag only: the grace then ends a main thread that never looks at it."""
    sig = _watch["interrupt_signal"]
    handler = None if sig is None else signal.getsignal(sig)
    if not callable(handler) or (sig == signal.SIGUSR1 and handler is not _raise_keyboard_interrupt):
        sig = None  # changed since the watchdog started: the signal would now do nothing, or end the process
    if sig is not None:
        signal.pthread_kill(threading.main_thread().ident, sig)
    else:
        _thread.interrupt_main()


def _flush_output() -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()


def _exit(code: int) -> None:
    """Ends the process at once (after flushing logs and output): JAX's own exit handler would wait for every
    process at a shutdown barrier, which processes that are gone never reach."""
    try:
        _flush_output()
    finally:
        os._exit(code)


def _at_exit() -> None:
    """At this process's exit (before JAX's own handler): a run that stopped on a failure ends its remaining child
    processes and exits at once with status 1 (an exception that nothing caught, raised outside the trainer's loop,
    is told to the others first); one that
    ends normally tells the others (who then stop watching it) and goes on to JAX's shutdown."""
    dog = _watch["dog"]
    if dog is None:
        return
    uncaught = getattr(sys, "last_value", None)  # set by Python for an exception that ended the main thread
    if uncaught is not None and dog.failure is None and not dog.failed_here:
        stopped_by(uncaught)
    if dog.failure is not None or dog.failed_here:
        log.debug("process %d ends on a failure: its child processes, then its last word to the others", dog.me)
        end_child_processes()  # whatever the run's own cleanup did not close (it may not have run at all)
        # Output flushed before saying so: once this process has said it ends, process 0 stays only
        # EXIT_LINGER_S, after which its coordinator's end makes JAX abort whoever is still running; saying it
        # is the last step.
        try:
            _flush_output()
        finally:
            dog.exiting()
            os._exit(1)
    dog.finish()

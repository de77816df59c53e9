"""Multi-process runs: jax.distributed started from `config.distributed`, and a check that every process started
with the same config and the same code.

`start(cfg)` is what the trainer calls, before anything touches a device (agentfly-train's main, and `loop.setup`
again, which is then a no-op):

1. `initialize(cfg.distributed)` calls `jax.distributed.initialize` with the section's values. With none set it
   does so only where a cluster that JAX recognises by itself holds several processes (`detect_cluster`: an Open
   MPI job or a SLURM step of several tasks, a Cloud TPU slice of several hosts) and lets JAX fill in every value;
   anywhere else the run is one process and nothing is started. `num_processes=1` forces one process. Set
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

import dataclasses
import hashlib
import json
import logging
import os
import socket
import sys
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
    if section.num_processes == 1:
        return False
    given = {k: v for k, v in explicit.items() if v is not None}
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
    kwargs = dict(given, initialization_timeout=section.initialization_timeout)
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
    """`initialize(cfg.distributed)`, then, with several processes, `check_same_everywhere(cfg)`; True when this
    run has several processes. Idempotent: a second call with the same config does nothing; with another config
    (a program that trains twice) the processes compare again."""
    if not initialize(cfg.distributed):
        return False
    digest = config_digest(cfg)
    if _rounds["checked"] != digest:
        check_same_everywhere(cfg)
        _rounds["checked"] = digest
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
    publish within `timeout_s` (default EXCHANGE_TIMEOUT_S) is named in a DistributedError."""
    state = _runtime()
    client, me, n = state.client, state.process_id, state.num_processes
    if client is None or not n or n == 1:
        return [value]
    timeout_s = EXCHANGE_TIMEOUT_S if timeout_s is None else timeout_s
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
        try:
            out.append(json.loads(client.blocking_key_value_get(f"{base}/{count}/{i}", int(timeout_s * 1000))))
        except Exception as e:  # a deadline or a coordinator gone: JAX's runtime error
            raise DistributedError(f"process {i} of {n} did not publish its share of exchange {count} within "
                                   f"{timeout_s:.0f} s: it failed or hangs, see its log "
                                   f"({str(e).strip().splitlines()[0] if str(e).strip() else e})") from e
    # every process has read every value of exchange count - 1 before it published this one, so the values of
    # count - 2 are read everywhere: this process's can go (the store would otherwise grow every step)
    if count > 2:
        try:
            client.key_value_delete(f"{base}/{count - 2}/{me}")
        except Exception as e:  # noqa: BLE001 - a value left in the store costs memory, not correctness
            log.debug("could not delete exchange %d's value: %s", count - 2, e)
    return out

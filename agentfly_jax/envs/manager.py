"""Central resource manager: named pools of environment instances shared by many concurrent chains.

    manager = ResourceManager({"code": {"factory": CodeInterpreterEnv, "max_size": 32, "min_size": 4}})
    async with manager.acquire("code", key=chain_id) as env:
        obs = await env.reset(task)
        result = await env.step(action)
    await manager.close()

- Acquiring a key that is already held returns the same instance (reference counted): a chain keeps its
  environment across turns, and every tool of that chain sees the same state.
- On the final release the instance is reset and health-checked in the background (an instance that set
  `retired = True` on itself is destroyed instead, e.g. a single-use container); a healthy one goes back
  to the idle stack (or straight to the longest waiter), an unhealthy or failing one is destroyed and
  replaced when someone needs it (or to keep `min_size` warm).
- A full pool queues acquirers first come, first served, up to `acquire_timeout`; then `PoolTimeoutError`
  names the pool, its size and the number of waiters.
- Idle instances above `min_size` are destroyed after `idle_timeout` seconds.
- Cancellation and exceptions inside `async with` always release; `await manager.close()` destroys all.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import importlib
import logging
import time
from typing import Any, Callable, Mapping

from agentfly_jax.envs.base import maybe_await

log = logging.getLogger(__name__)

_LATENCY_WINDOW = 100_000  # acquire latencies kept per pool for the percentiles


class PoolTimeoutError(TimeoutError):
    """No instance of a pool became available within the acquire timeout."""


class PoolClosedError(RuntimeError):
    """The manager was closed (or is closing) while an acquire was pending or started."""


class EnvironmentCreationError(RuntimeError):
    """A pool's factory raised or timed out while creating an instance."""


def resolve_factory(factory: Any) -> Callable[..., Any]:
    """A callable for `factory`: a callable, or an import path ("package.module:attr" or "....attr")."""
    if callable(factory):
        return factory
    if not isinstance(factory, str) or not factory:
        raise TypeError(f"pool factory must be a callable or an import path string, got {factory!r}")
    module_name, sep, attr = factory.partition(":")
    if not sep:
        module_name, _, attr = factory.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"pool factory {factory!r} is not an import path; expected 'package.module:Name'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"pool factory {factory!r} cannot be imported ({e}); check the module path and name"
        ) from e
    if not callable(obj):
        raise TypeError(f"pool factory {factory!r} resolves to {obj!r}, which is not callable")
    return obj


@dataclasses.dataclass
class PoolConfig:
    """Configuration of one named pool.

    factory: callable (sync or async) returning a new environment, or an import path to one; called as
      `factory(**kwargs)`.
    min_size: instances kept warm (created in the background, never reaped).
    max_size: hard cap on live instances (in use + idle + being created, reset or destroyed).
    idle_timeout: seconds an idle instance above `min_size` lives; None keeps idle instances forever.
    acquire_timeout: seconds an acquire may wait (queueing + creation); None waits forever.
    create_timeout / reset_timeout / close_timeout: limits on the factory, on reset + health check at
      release, and on close; a timeout counts as a failure (the instance is then destroyed).
    reset_on_release: reset the instance when its last holder releases it (health is always checked).
    """

    factory: Any
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    min_size: int = 0
    max_size: int = 16
    idle_timeout: float | None = 300.0
    acquire_timeout: float | None = 60.0
    create_timeout: float | None = 120.0
    reset_timeout: float = 60.0
    close_timeout: float = 30.0
    reset_on_release: bool = True

    def __post_init__(self):
        self.factory = resolve_factory(self.factory)
        self.kwargs = dict(self.kwargs)
        if self.max_size < 1:
            raise ValueError(f"max_size={self.max_size}; a pool needs max_size >= 1")
        if not 0 <= self.min_size <= self.max_size:
            raise ValueError(f"min_size={self.min_size} must be between 0 and max_size={self.max_size}")
        for name in ("idle_timeout", "acquire_timeout", "create_timeout", "reset_timeout", "close_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}={value}; timeouts must be positive seconds (or None where allowed)")

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "PoolConfig":
        """Builds a config from a dict / ml_collections ConfigDict; unknown keys are an error."""
        if hasattr(config, "to_dict"):
            config = config.to_dict()
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown pool config keys {unknown}; expected some of {sorted(known)}")
        if "factory" not in config:
            raise ValueError("pool config needs a 'factory' (callable or 'package.module:Name')")
        return cls(**config)


class _Entry:
    """One live instance and its bookkeeping."""

    __slots__ = ("env", "state", "last_used", "uses", "destroyed")

    def __init__(self, env: Any):
        self.env = env
        self.state = "new"  # idle | handoff | in_use | recycling | closing
        self.last_used = time.monotonic()
        self.uses = 0
        self.destroyed = False


class _Lease:
    """All holders of one key: a reference count and the task obtaining the instance."""

    __slots__ = ("key", "refcount", "entry", "task", "phase")

    def __init__(self, key: Any):
        self.key = key
        self.refcount = 0
        self.entry: _Entry | None = None
        self.task: asyncio.Task | None = None
        self.phase = "waiting"  # waiting | creating (for timeout messages)


class _Pool:
    def __init__(self, name: str, config: PoolConfig):
        self.name = name
        self.config = config
        self.entries: set[_Entry] = set()
        self.idle: list[_Entry] = []  # oldest first; reuse takes the most recently used (warm caches)
        self.leases: dict[Any, _Lease] = {}
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.creating = 0
        self.fill_failures = 0
        self.fill_backoff_until = 0.0
        self.counters = collections.Counter()
        self.latencies: collections.deque[float] = collections.deque(maxlen=_LATENCY_WINDOW)

    @property
    def size(self) -> int:
        return len(self.entries) + self.creating

    def count(self, state: str) -> int:
        return sum(1 for e in self.entries if e.state == state)

    def n_waiting(self) -> int:
        return sum(1 for w in self.waiters if not w.done())


class _Acquire:
    """`async with manager.acquire(pool, key) as env` — see ResourceManager.acquire."""

    def __init__(self, manager: "ResourceManager", pool: _Pool, key: Any):
        self._manager = manager
        self._pool = pool
        self._key = key
        self._lease: _Lease | None = None

    async def __aenter__(self) -> Any:
        if self._lease is not None:
            raise RuntimeError("this acquire context is already entered; call manager.acquire() again")
        self._lease, env = await self._manager._acquire(self._pool, self._key)
        return env

    async def __aexit__(self, *exc_info) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            self._manager._drop(self._pool, lease)


class ResourceManager:
    """Named pools of environment instances; see the module docstring."""

    def __init__(
        self, pools: Mapping[str, PoolConfig | Mapping[str, Any]] | None = None, *, reap_interval: float = 1.0
    ):
        if reap_interval <= 0:
            raise ValueError(f"reap_interval={reap_interval}; expected positive seconds")
        if pools is not None and hasattr(pools, "to_dict"):
            pools = pools.to_dict()
        self._pools: dict[str, _Pool] = {}
        self._reap_interval = reap_interval
        self._tasks: set[asyncio.Task] = set()  # creations and recycles: cancelled by close()
        self._destroys: set[asyncio.Task] = set()  # destructions: close() lets them finish
        self._reaper: asyncio.Task | None = None
        self._closed = False
        for name, config in (pools or {}).items():
            self.add_pool(name, config)

    # ----------------------------------------------------------------------------------------- public API

    def add_pool(self, name: str, config: PoolConfig | Mapping[str, Any]) -> None:
        """Registers pool `name`; `config` is a PoolConfig or a dict of its fields."""
        if name in self._pools:
            raise ValueError(f"pool {name!r} already exists")
        if not isinstance(config, PoolConfig):
            config = PoolConfig.from_dict(config)
        self._pools[name] = _Pool(name, config)

    @property
    def pool_names(self) -> list[str]:
        return list(self._pools)

    def acquire(self, pool: str, key: Any = None) -> _Acquire:
        """Async context manager yielding an instance of `pool`.

        The same `key` (e.g. a chain id) gets the same instance while any holder keeps it; `key=None` gets
        a private instance. Waits up to the pool's acquire_timeout when the pool is full.
        """
        if pool not in self._pools:
            raise KeyError(f"unknown pool {pool!r}; configured pools: {sorted(self._pools)}")
        return _Acquire(self, self._pools[pool], object() if key is None else key)

    async def start(self) -> None:
        """Creates the warm (`min_size`) instances of every pool and waits for them; optional."""
        self._check_open()
        creations = [task for pool in self._pools.values() for task in self._fill_min(pool, force=True)]
        self._ensure_reaper()
        await asyncio.gather(*creations, return_exceptions=True)

    def metrics(self, pool: str | None = None) -> dict[str, Any]:
        """Counters of one pool, or {pool name: counters} for all.

        in_use / idle / waiting / creating / recycling (reset + health check) / size: current numbers;
        created / destroyed / failures (factory, reset, health-check or close errors and timeouts) /
        unhealthy (health check returned False) / retired (instances that declared themselves used up with
        `env.retired = True`, destroyed without a warning) / reaped (idle too long) / timeouts (acquires that
        gave up) / acquires: totals;
        acquire_latency_s: mean / p50 / p99 / max seconds from acquire to instance, over recent acquires.
        """
        if pool is not None:
            return self._metrics(self._pools[pool])
        return {name: self._metrics(p) for name, p in self._pools.items()}

    async def close(self) -> None:
        """Destroys every instance (idle, in use or being recycled) and fails pending acquires; idempotent."""
        if (
            self._closed
            and not self._tasks
            and not self._destroys
            and not any(p.entries for p in self._pools.values())
        ):
            return
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
        for pool in self._pools.values():
            while pool.waiters:
                waiter = pool.waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(
                        PoolClosedError(f"pool {pool.name!r}: the resource manager was closed")
                    )
            for lease in pool.leases.values():
                if lease.task is not None and not lease.task.done():
                    lease.task.cancel()
        tasks = list(self._tasks) + ([self._reaper] if self._reaper else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while self._destroys:  # each is bounded by its pool's close_timeout
            await asyncio.gather(*list(self._destroys), return_exceptions=True)
        for pool in self._pools.values():
            pool.creating = 0  # creations cancelled before they started never decremented their reservation
            pool.idle.clear()
            pool.waiters.clear()
            await asyncio.gather(*(self._destroy(pool, e, refill=False) for e in list(pool.entries)))

    async def __aenter__(self) -> "ResourceManager":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # ------------------------------------------------------------------------------------ acquire / release

    async def _acquire(self, pool: _Pool, key: Any) -> tuple[_Lease, Any]:
        self._check_open()
        self._ensure_reaper()
        start = time.monotonic()
        lease = pool.leases.get(key)
        if lease is None and pool.idle and not pool.n_waiting():
            # Fast path: a warm instance and nobody queued before us; no task, no suspension.
            lease = _Lease(key)
            lease.refcount = 1
            pool.leases[key] = lease
            entry = pool.idle.pop()
            self._assign(pool, lease, entry)
            pool.latencies.append(time.monotonic() - start)
            pool.counters["acquires"] += 1
            return lease, entry.env
        if lease is None:
            lease = _Lease(key)
            pool.leases[key] = lease
            lease.task = asyncio.get_running_loop().create_task(self._obtain(pool, lease))
            lease.task.add_done_callback(lambda t, p=pool, held=lease: self._obtained(p, held, t))
        lease.refcount += 1
        if lease.entry is not None:
            return lease, lease.entry.env
        timeout = pool.config.acquire_timeout
        try:
            await asyncio.wait_for(asyncio.shield(lease.task), timeout)
        except asyncio.TimeoutError:
            # Numbers are taken before this acquirer leaves the queue, so they include it.
            message = (
                f"pool {pool.name!r}: no environment within {timeout:g} s while {lease.phase} "
                f"(size {pool.size}/"
                f"{pool.config.max_size}, {pool.count('in_use')} in use, {pool.n_waiting()} waiting); raise "
                f"max_size or acquire_timeout for this pool, or have chains release environments sooner"
            )
            self._drop(pool, lease)
            pool.counters["timeouts"] += 1
            raise PoolTimeoutError(message) from None
        except asyncio.CancelledError:
            self._drop(pool, lease)
            if self._closed and lease.task.cancelled() and not asyncio.current_task().cancelling():
                raise PoolClosedError(f"pool {pool.name!r}: the resource manager was closed") from None
            raise
        except BaseException:
            self._drop(pool, lease)
            raise
        if lease.entry is None:  # the done-callback has not run yet
            self._assign(pool, lease, lease.task.result())
        pool.latencies.append(time.monotonic() - start)
        pool.counters["acquires"] += 1
        return lease, lease.entry.env

    async def _obtain(self, pool: _Pool, lease: _Lease) -> _Entry:
        """Finds an instance for `lease`: idle first, then a new one if below max_size, else queue."""
        front = False
        while True:
            self._check_open()
            if pool.idle:
                entry = pool.idle.pop()
                entry.state = "handoff"
                return entry
            if pool.size < pool.config.max_size:
                lease.phase = "creating"
                entry = await self._create(pool)
                entry.state = "handoff"
                return entry
            lease.phase = "waiting"
            waiter = asyncio.get_running_loop().create_future()
            # A waiter woken for freed capacity that lost it to a newcomer keeps its place at the front.
            pool.waiters.appendleft(waiter) if front else pool.waiters.append(waiter)
            try:
                entry = await waiter
            except asyncio.CancelledError:
                if not waiter.done():
                    waiter.cancel()
                elif not waiter.cancelled() and waiter.exception() is None and waiter.result() is not None:
                    self._make_idle(pool, waiter.result())  # handed to us just as we were cancelled
                raise
            finally:
                try:
                    pool.waiters.remove(waiter)
                except ValueError:
                    pass
            if entry is not None:
                return entry
            front = True  # woken because capacity was freed: go round and create

    def _obtained(self, pool: _Pool, lease: _Lease, task: asyncio.Task) -> None:
        """Done-callback of an obtain task: hand the instance to the lease, or back to the pool."""
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            if pool.leases.get(lease.key) is lease:  # new acquirers of this key start afresh
                del pool.leases[lease.key]
            return
        entry = task.result()
        if lease.refcount > 0 and lease.entry is None:
            self._assign(pool, lease, entry)
        elif lease.entry is not entry:
            self._make_idle(pool, entry)  # every holder gave up while it was being obtained

    def _assign(self, pool: _Pool, lease: _Lease, entry: _Entry) -> None:
        if lease.entry is entry:
            return
        lease.entry = entry
        entry.state = "in_use"
        entry.uses += 1

    def _drop(self, pool: _Pool, lease: _Lease) -> None:
        """One holder of `lease` is done (normally, by exception, timeout or cancellation)."""
        lease.refcount -= 1
        if lease.refcount > 0:
            return
        if pool.leases.get(lease.key) is lease:
            del pool.leases[lease.key]
        entry, lease.entry = lease.entry, None
        if entry is not None:
            if entry.destroyed:  # the manager was closed while it was held
                return
            entry.state = "recycling"
            self._spawn(self._recycle(pool, entry))
        elif lease.task is not None and not lease.task.done():
            lease.task.cancel()

    # ------------------------------------------------------------------------------------------ lifecycle

    async def _create(self, pool: _Pool, reserved: bool = False) -> _Entry:
        config = pool.config
        if not reserved:
            pool.creating += 1
        try:
            env = await asyncio.wait_for(maybe_await(config.factory(**config.kwargs)), config.create_timeout)
        except asyncio.CancelledError:
            pool.creating -= 1
            self._wake(pool)
            raise
        except Exception as e:
            pool.creating -= 1
            pool.counters["failures"] += 1
            pool.counters["create_failures"] += 1
            log.warning("pool %r: creating an environment failed: %r", pool.name, e)
            self._wake(pool)
            what = "timed out" if isinstance(e, asyncio.TimeoutError) else f"failed ({e!r})"
            raise EnvironmentCreationError(
                f"pool {pool.name!r}: creating an environment {what}; check the pool's factory "
                f"{getattr(config.factory, '__qualname__', config.factory)!s} and its kwargs"
            ) from e
        pool.creating -= 1
        entry = _Entry(env)
        pool.entries.add(entry)
        pool.counters["created"] += 1
        return entry

    async def _create_idle(self, pool: _Pool) -> None:
        try:
            entry = await self._create(pool, reserved=True)
        except EnvironmentCreationError:
            # Counted and logged; the reaper tries again after a back-off that doubles up to a minute.
            pool.fill_failures += 1
            pool.fill_backoff_until = time.monotonic() + min(60.0, 0.5 * 2**pool.fill_failures)
            return
        pool.fill_failures = 0
        self._make_idle(pool, entry)

    async def _recycle(self, pool: _Pool, entry: _Entry) -> None:
        """Reset + health check after the final release; keep the instance or destroy and replace it."""
        config = pool.config
        env = entry.env
        if getattr(env, "retired", False):  # single-use by its own choice: destroy without a warning
            pool.counters["retired"] += 1
            self._spawn_destroy(pool, entry)
            return
        healthy = False
        try:
            if config.reset_on_release:
                await asyncio.wait_for(maybe_await(env.reset()), config.reset_timeout)
            health = getattr(env, "health", None)
            healthy = (
                True
                if health is None
                else bool(await asyncio.wait_for(maybe_await(health()), config.reset_timeout))
            )
            if not healthy:
                pool.counters["unhealthy"] += 1
                log.warning("pool %r: environment %r failed its health check; destroying it", pool.name, env)
        except asyncio.CancelledError:
            raise  # the manager is closing; close() destroys what is left
        except Exception as e:
            pool.counters["failures"] += 1
            log.warning("pool %r: reset/health check of %r failed (%r); destroying it", pool.name, env, e)
        if healthy and not self._closed:
            entry.last_used = time.monotonic()
            self._make_idle(pool, entry)
        else:
            self._spawn_destroy(pool, entry)

    async def _destroy(self, pool: _Pool, entry: _Entry, refill: bool = True) -> None:
        if entry.destroyed:
            return
        entry.destroyed = True
        entry.state = "closing"
        if entry in pool.idle:
            pool.idle.remove(entry)
        try:
            await asyncio.wait_for(maybe_await(entry.env.close()), pool.config.close_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            pool.counters["failures"] += 1
            log.warning("pool %r: closing environment %r failed: %r", pool.name, entry.env, e)
        finally:
            pool.entries.discard(entry)
            pool.counters["destroyed"] += 1
        if refill:
            self._wake(pool)
            self._fill_min(pool)

    def _make_idle(self, pool: _Pool, entry: _Entry) -> None:
        """Gives `entry` to the longest waiter, or puts it on the idle stack."""
        if self._closed or entry.destroyed:
            return
        while pool.waiters:
            waiter = pool.waiters.popleft()
            if not waiter.done():
                entry.state = "handoff"
                waiter.set_result(entry)
                return
        entry.state = "idle"
        entry.last_used = time.monotonic()
        pool.idle.append(entry)

    def _wake(self, pool: _Pool) -> None:
        """Capacity was freed: let as many waiters create as there is room for."""
        room = pool.config.max_size - pool.size
        for waiter in list(pool.waiters):
            if room <= 0:
                break
            if not waiter.done():
                waiter.set_result(None)
                room -= 1

    def _fill_min(self, pool: _Pool, force: bool = False) -> list[asyncio.Task]:
        """Starts creations up to min_size (after a failed creation, not before its back-off ends)."""
        if self._closed or (not force and time.monotonic() < pool.fill_backoff_until):
            return []
        tasks = []
        for _ in range(max(0, pool.config.min_size - pool.size)):
            pool.creating += 1  # reserved now, so a second call before the task starts does not overshoot
            tasks.append(self._spawn(self._create_idle(pool)))
        return tasks

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _spawn_destroy(self, pool: _Pool, entry: _Entry) -> None:
        task = asyncio.get_running_loop().create_task(self._destroy(pool, entry))
        self._destroys.add(task)
        task.add_done_callback(self._destroys.discard)

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())
            for pool in self._pools.values():
                self._fill_min(pool)

    async def _reap_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._reap_interval)
            now = time.monotonic()
            for pool in self._pools.values():
                timeout = pool.config.idle_timeout
                if timeout is not None:
                    removable = pool.size - pool.config.min_size
                    for entry in list(pool.idle):  # oldest first
                        if removable <= 0 or now - entry.last_used < timeout:
                            break
                        pool.idle.remove(entry)
                        pool.counters["reaped"] += 1
                        removable -= 1
                        self._spawn_destroy(pool, entry)
                self._fill_min(pool)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the resource manager is closed; create a new ResourceManager")

    def _metrics(self, pool: _Pool) -> dict[str, Any]:
        c = pool.counters
        lat = sorted(pool.latencies)

        def pct(q: float) -> float:
            return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0

        return {
            "in_use": pool.count("in_use"),
            "idle": len(pool.idle),
            "waiting": pool.n_waiting(),
            "creating": pool.creating,
            "recycling": pool.count("recycling"),
            "size": pool.size,
            "max_size": pool.config.max_size,
            "created": c["created"],
            "destroyed": c["destroyed"],
            "failures": c["failures"],
            "unhealthy": c["unhealthy"],
            "reaped": c["reaped"],
            "retired": c["retired"],
            "timeouts": c["timeouts"],
            "acquires": c["acquires"],
            "acquire_latency_s": {
                "mean": sum(lat) / len(lat) if lat else 0.0,
                "p50": pct(0.5),
                "p99": pct(0.99),
                "max": lat[-1] if lat else 0.0,
            },
        }

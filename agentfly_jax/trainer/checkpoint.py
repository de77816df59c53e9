"""Orbax checkpoints of the whole training state: params, optimiser state, step, data position, RNG and the
backend's weight version.

Every checkpoint carries a checksum of each array (BLAKE2b of its bytes, in the JSON metadata); a checkpoint
that does not load, or whose restored arrays do not match their checksums (a flipped byte loads silently
otherwise), is skipped with a warning and the next older one is tried. Nothing is deleted at restore (a load
can also fail for a passing reason); when the run retrains a skipped step and saves it, the broken copy is
moved aside to `<directory>.corrupt/` first (by process 0; on non-local storage it is deleted). Arrays that
span several processes (multi-host) are not checksummed, only what one process holds whole, and only arrays
checksummed both at save and at restore are compared (a restore on another topology does not fail them)."""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import shutil
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


def _digest(leaf) -> str:
    value = np.ascontiguousarray(jax.device_get(leaf))
    digest = hashlib.blake2b(f"{value.dtype}{value.shape}".encode(), digest_size=16)
    digest.update(value.reshape(-1).view(np.uint8))  # raw bytes without a copy (bf16 has no buffer format)
    return digest.hexdigest()


def checksums(tree: Any) -> dict[str, str]:
    """{leaf path: BLAKE2b-128 of dtype, shape and bytes} of the arrays of `tree` this process holds whole
    (hashed in threads: hashlib releases the GIL on large buffers)."""
    leaves = [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
              if not (isinstance(leaf, jax.Array) and not leaf.is_fully_addressable)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip((k for k, _ in leaves), pool.map(_digest, (v for _, v in leaves))))


class Checkpointer:
    """Saves every `every` steps, keeps the last `keep`; `restore_latest` falls back past broken ones."""

    def __init__(self, directory: str, *, every: int, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.every = int(every)
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))
        self.skipped: list[tuple[int, str]] = []  # (step, why) of checkpoints restore_latest did not trust

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Writes `state` (a pytree of arrays) and `meta` (JSON, with the arrays' checksums added) for `step`;
        waits until it is on disk. A step that already has a checkpoint is left as it is (returns False)."""
        if step in self.manager.all_steps():
            if step not in {s for s, _ in self.skipped}:
                return False
            self._move_aside(step)  # a broken checkpoint of a step the run has now trained again
            self.skipped = [(s, why) for s, why in self.skipped if s != step]
        meta = {**meta, "checksums": checksums(state)}
        saved = self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=force)
        self.manager.wait_until_finished()
        return bool(saved)

    def restore_latest(self, target: Any, settings: dict[str, tuple[Any, Any]] | None = None
                       ) -> tuple[int, Any, dict] | None:
        """(step, state, meta) of the newest checkpoint that loads and matches its checksums, restored with
        `target`'s shapes, dtypes and shardings; None when there is none. Broken ones are skipped with a warning
        and moved aside.

        settings: meta key -> (the value this run needs, the value a checkpoint without the key was saved with):
        settings that decide the state's layout. A checkpoint saved with another value is not broken but made by
        another configuration: ConfigError, naming the key (rather than skipping every checkpoint and starting
        over)."""
        from agentfly_jax.trainer.config import ConfigError

        self.manager.reload()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        for step in sorted(self.manager.all_steps(), reverse=True):
            if settings:
                try:
                    saved = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                except Exception:  # noqa: BLE001 - an unreadable meta: the full restore below skips it
                    saved = None
                for key, (needed, absent) in settings.items() if saved is not None else ():
                    if saved.get(key, absent) != needed:
                        raise ConfigError(f"checkpoint {step} in {self.directory} was saved with {key}="
                                          f"{saved.get(key, absent)!r}, this run has {needed!r}: its state does not "
                                          "load under another value; resume with the checkpoint's setting or start "
                                          "in a new workdir")
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
            except Exception as exc:  # noqa: BLE001 - any failure means: do not trust this checkpoint
                self._skip(step, f"it does not load ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:200] if str(exc) else ''})")
                continue
            meta = dict(restored["meta"])
            expected = meta.pop("checksums", None)
            if expected is None:
                log.warning("checkpoint %d in %s has no checksums (written before they were added): loaded "
                            "unverified", step, self.directory)
            else:
                actual = checksums(restored["state"])
                bad = sorted(k for k in expected.keys() & actual.keys() if expected[k] != actual[k])
                if bad:
                    self._skip(step, f"{len(bad)} arrays do not match their checksums (first: {', '.join(bad[:3])})")
                    continue
            return step, restored["state"], meta
        return None

    def _skip(self, step: int, why: str) -> None:
        """Logs and records a checkpoint that is not trusted (restore goes on to an older one)."""
        log.warning("skipping checkpoint %d in %s: %s", step, self.directory, why)
        self.skipped.append((step, why))

    def _move_aside(self, step: int) -> None:
        """Moves a skipped checkpoint out of the manager's directory (to `<directory>.corrupt/<step>-<time>`,
        kept for inspection; deleted on non-local storage) so that its step can be saved again."""
        if jax.process_index() == 0:
            source = os.path.join(self.directory, str(step))
            if os.path.isdir(source):
                aside = os.path.join(f"{self.directory}.corrupt", f"{step}-{int(time.time())}")
                os.makedirs(os.path.dirname(aside), exist_ok=True)
                shutil.move(source, aside)
                log.warning("moved the broken checkpoint %d aside to %s", step, aside)
            else:
                self.manager.delete(step)
                log.warning("deleted the broken checkpoint %d in %s", step, self.directory)
        self.manager.reload()

    def close(self) -> None:
        self.manager.close()

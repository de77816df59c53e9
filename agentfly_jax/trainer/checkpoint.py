"""Orbax checkpoints of the whole training state: params, optimiser state, step, data position, RNG and the
backend's weight version. A corrupt or partial checkpoint is skipped with a warning, never loaded."""
from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves every `every` steps, keeps the last `keep`; `restore_latest` falls back past broken ones."""

    def __init__(self, directory: str, *, every: int, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.every = int(every)
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Writes `state` (a pytree of arrays) and `meta` (JSON) for `step`; waits until it is on disk.
        A step that already has a checkpoint is left as it is (returns False)."""
        if step in self.manager.all_steps():
            return False
        saved = self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=force)
        self.manager.wait_until_finished()
        return bool(saved)

    def restore_latest(self, target: Any) -> tuple[int, Any, dict] | None:
        """(step, state, meta) of the newest checkpoint that loads, restored with `target`'s shapes, dtypes and
        shardings; None when there is none. Checkpoints that fail to load are skipped with a warning."""
        self.manager.reload()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
            except Exception as exc:  # noqa: BLE001 - any failure means: do not trust this checkpoint
                log.warning("skipping checkpoint %d in %s: it does not load (%s: %s)", step, self.directory,
                            type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
                continue
            return step, restored["state"], dict(restored["meta"])
        return None

    def close(self) -> None:
        self.manager.close()

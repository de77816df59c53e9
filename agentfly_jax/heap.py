"""The start-up heap, frozen out of the garbage collector's reach (what the trainer does once it is set up).

A trainer process holds some 280,000 objects from its imports (transformers, jax, torch) and set-up before the
first rollout. A full garbage collection walks every one of them (0.15-0.25 s on a slow CPU), and a rollout
allocates enough asyncio tasks, futures and lists to set one off in most steps. None of those objects is
garbage: `freeze_startup_heap()` collects once, then moves every object that survives into the collector's
permanent generation (`gc.freeze()`), so that later collections walk only what was made after it.

Reference counting still frees frozen objects; only reference cycles among them that become unreachable later
are no longer collected (until `unfreeze_startup_heap`). Objects made during start-up are few and long-lived, so
that bounded leak is the price of not walking them on every full collection.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> bool:
    """`gc.collect()`, then `gc.freeze()`: every object that exists now is left out of later collections.

    Returns True when the heap was not frozen before (this call owns the freeze: give it back with
    `unfreeze_startup_heap(True)` when the work is done), False when something had frozen objects already
    (the objects made since are frozen along, and the freeze stays that owner's to undo).
    """
    owner = gc.get_freeze_count() == 0
    gc.collect()
    gc.freeze()
    return owner


def unfreeze_startup_heap(owner: bool) -> None:
    """Give the frozen objects back to the collector (`gc.unfreeze()`) when `owner` (what `freeze_startup_heap`
    returned) says this process's freeze was the one made there; nothing otherwise."""
    if owner:
        gc.unfreeze()

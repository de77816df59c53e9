"""agentfly_jax.heap: the start-up heap frozen out of the collector's reach, and given back by its owner only."""

import gc
import weakref

from agentfly_jax.heap import freeze_startup_heap, unfreeze_startup_heap


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def test_freezing_leaves_the_start_up_objects_out_of_collections_until_the_owner_gives_them_back():
    assert gc.get_freeze_count() == 0
    try:
        garbage, kept = Node(), Node()
        garbage_ref, kept_ref = weakref.ref(garbage), weakref.ref(kept)
        del garbage
        assert freeze_startup_heap()  # nothing was frozen before: this call owns the freeze
        assert garbage_ref() is None  # collected before the freeze, not frozen with the rest
        assert gc.get_freeze_count() > 1000
        del kept
        gc.collect()
        assert kept_ref() is not None  # unreachable now, but frozen: no collection frees it

        frozen = gc.get_freeze_count()
        assert not freeze_startup_heap()  # frozen already (by another owner): later objects join that freeze
        unfreeze_startup_heap(False)  # not the owner: the freeze stays
        assert gc.get_freeze_count() >= frozen

        unfreeze_startup_heap(True)
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert kept_ref() is None  # back in the collector's reach
    finally:
        gc.unfreeze()

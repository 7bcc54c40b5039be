"""``common/gc_heap.py``: the startup heap frozen out of the collector's walk, and its pauses measured."""

import gc

from common.gc_heap import GcPauses, freeze_startup_heap


def test_freeze_collects_first_and_later_cycles_are_still_collected():
    """Garbage from before the freeze is collected, not frozen; objects alive then are frozen; a cycle
    made afterwards is still found by a collection (the collector is narrowed, not off)."""
    class Node:
        pass

    garbage = Node()
    garbage.self = garbage  # a cycle no one holds
    del garbage
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 0
        assert not any(type(o) is Node for o in gc.get_objects())  # the cycle was collected first
        late = Node()
        late.self = late
        del late
        assert gc.collect() >= 1  # a cycle made after the freeze is still collected
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_pauses_count_collections_per_generation():
    pauses = GcPauses().install()
    try:
        gc.collect(0)
        gc.collect()
        collections, seconds = pauses.snapshot()
        assert collections[0] >= 1 and collections[2] >= 1 and all(s >= 0 for s in seconds)
    finally:
        pauses.remove()
    gc.collect()
    assert pauses.snapshot()[0] == collections  # removed: no longer counted

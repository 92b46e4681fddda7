"""A worker's start-up heap frozen out of the garbage collector's walks (``rlc.runtime.gc_heap``)."""
from __future__ import annotations

import gc
import weakref

from rlc.runtime.gc_heap import freeze_heap


class Node:
    def __init__(self) -> None:
        self.other: "Node | None" = None


def test_garbage_is_collected_first_and_what_is_alive_is_frozen():
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    dead = weakref.ref(a)
    del a, b
    kept = Node()
    try:
        frozen = freeze_heap()
        assert dead() is None  # collected before the freeze, not frozen with the rest
        assert frozen == gc.get_freeze_count() > 0
        # what was alive is out of every generation the collector walks; what is created afterwards is in one
        assert not any(o is kept for o in gc.get_objects())
        fresh = Node()
        assert any(o is fresh for o in gc.get_objects())
        c, d = Node(), Node()
        c.other, d.other = d, c
        later = weakref.ref(c)
        del c, d
        gc.collect()
        assert later() is None
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0

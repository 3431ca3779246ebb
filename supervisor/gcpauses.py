"""Short garbage-collection pauses for a process that hosts a supervision loop.

A supervision tree's loop (:class:`erlay.supervisor.tree.SupervisionTree`) shares its process,
and so its GIL, with whatever else the process runs: in a job's driver, the coordinator and
its rollout journal, whose state holds hundreds of thousands of small containers.  With
CPython's default thresholds (700, 10, 10) that heap is scanned by a full collection about
once a second, and each full collection holds the GIL for 40–130 ms (more as the heap
grows): the supervision loop fires nothing meanwhile (``bench/loop_lag.py`` measured a p99
timer lag of 50 ms, with the stall found by timing ``gc.callbacks``).

:func:`short_gc_pauses` raises the thresholds for the time it is entered: a young collection
every :data:`THRESHOLDS` [0] net allocations (so short-lived rollout objects die before they
are promoted) and a full one at most every ``THRESHOLDS[1] x THRESHOLDS[2]`` young
collections (and, as always in CPython, only once the long-lived objects grew by a quarter).
Nothing that is garbage is kept for good: cycles are still collected, later.

Contract: process-wide (``gc`` has no other scope); restores the thresholds it found on exit.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

THRESHOLDS = (10_000, 20, 100)


@contextmanager
def short_gc_pauses(thresholds: tuple[int, int, int] = THRESHOLDS) -> Iterator[None]:
    """Run the body with ``gc`` thresholds ``thresholds``; the previous ones come back
    after, whatever the body does."""
    before = gc.get_threshold()
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*before)

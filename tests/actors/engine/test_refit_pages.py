"""A copied refit bucket's pages leave the engine's resident set (refit_load.release_pages),
and the data behind a shared mapping survives it: other readers of the same object store
bucket still read the weights."""

from __future__ import annotations

import mmap
import tempfile

import numpy as np

from erlay.actors.engine.refit_load import release_pages

MIB = 2**20


def rss_shmem() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def test_a_shared_buckets_pages_are_released_and_its_data_kept() -> None:
    size = 64 * MIB
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
        f.truncate(size)
        with mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED) as m:
            bucket = np.frombuffer(m, dtype=np.uint8)
            bucket[:] = 7                      # touched: resident in this process
            before = rss_shmem()
            released = release_pages(bucket)
            after = rss_shmem()
            # Every whole page of the buffer, and the resident count falls by about them.
            assert released == size
            assert before - after >= size - 4 * MIB, (before, after)
            # Another reader of the same shared file (the store, another engine) still
            # reads the weights: the pages were unmapped here, not freed.
            with open(f.name, "rb") as again:
                assert set(again.read(4 * MIB)) == {7}
            assert int(bucket[12345]) == 7     # refaulted from the file, not zeros
            del bucket


def test_only_whole_pages_inside_the_buffer_are_touched() -> None:
    page = mmap.PAGESIZE
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
        f.truncate(4 * page)
        with mmap.mmap(f.fileno(), 4 * page, flags=mmap.MAP_SHARED) as m:
            whole = np.frombuffer(m, dtype=np.uint8)
            # A view that starts mid-page and ends mid-page covers two whole pages.
            assert release_pages(whole[page // 2: 3 * page + 1]) == 2 * page
            assert release_pages(whole[10:page - 10]) == 0
            assert release_pages(whole[:0]) == 0
            del whole

"""The slab: one engine's saved KV caches on its node, as a sparse memory-mapped file (the
layout of :mod:`erlay.actors.engine.kv_handoff`; the store there decides what goes in).

A file starts with a header (magic, slots, positions, the cache's shape, dtype, the owner's
pid), then a table of one row per slot (the key's digest, policy version, positions covered,
``kv_sum``, the ring of hidden-state positions and sums, when it was claimed, and whether it
is valid), then the slots, each page-aligned: the context tokens ``[positions]``, keys and
values ``[positions, 2, layers, heads, head_dim]`` and a ring of :data:`RING` hidden states
``[RING, hidden]``.  Every array is a numpy view straight into the map, so a write is a store
into node memory that outlives the process, and another process reads it by mapping the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE
# Hidden states kept per slot, one per save point: a resume can start at any of the last
# RING save points without a prefill (an engine can run a few chunks ahead of its caller).
RING = 8
MAGIC = b"EKVS0001"
# magic, slots, positions, layers, heads, head_dim, hidden, dtype code, pid
_META = struct.Struct("<8siiiiiiii")
TABLE = np.dtype([("digest", "<u8", (2,)), ("version", "<i8"), ("covered", "<i8"),
                  ("kv_sum", "<u8"), ("hidden_at", "<i8", (RING,)),
                  ("hidden_sum", "<u8", (RING,)),
                  ("created_ns", "<i8"), ("state", "<i8")])
DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<i2")}
_NAMES = list(DTYPES)

@dataclass(frozen=True)
class Shape:
    """What a slab holds per position: ``layers x heads x head_dim`` keys and values in
    ``dtype`` (a :data:`DTYPES` name), and a ``hidden``-wide hidden state per slot."""

    layers: int
    heads: int
    head_dim: int
    hidden: int
    dtype: str

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (2, self.layers, self.heads, self.head_dim)

    def position_bytes(self) -> int:
        """Bytes of KV per token, keys and values of every layer."""
        return 2 * self.layers * self.heads * self.head_dim * DTYPES[self.dtype].itemsize


def digest(key: str) -> np.ndarray:
    return np.frombuffer(hashlib.blake2b(key.encode(), digest_size=16).digest(), "<u8")


def word_sums(a: np.ndarray) -> np.ndarray:
    """Per row of ``a``: the sum of its 64-bit words, mod 2^64 (of its 32-bit words, widened,
    when a row is not whole 64-bit words)."""
    rows = np.ascontiguousarray(a).reshape(len(a), -1)
    if rows.nbytes % (8 * max(len(a), 1)) == 0:
        return rows.view("<u8").sum(axis=1)
    return rows.view("<u4").sum(axis=1, dtype=np.uint64)


class Slab:
    """One engine's slab file, mapped (see the module docstring)."""

    def __init__(self, path: Path, mm: mmap.mmap, slots: int, positions: int,
                 shape: Shape, pid: int) -> None:
        self.path, self.mm, self.pid = path, mm, pid
        self.slots, self.positions, self.shape = slots, positions, shape
        item = DTYPES[shape.dtype].itemsize
        self.table_bytes = _round(_META.size + TABLE.itemsize * slots)
        raw = 4 * positions + shape.position_bytes() * positions + RING * item * shape.hidden
        self.stride = _round(raw)
        self.table = np.ndarray((slots,), TABLE, mm, _META.size)
        base = self.table_bytes
        self.tokens = np.ndarray((slots, positions), "<i4", mm, base, (self.stride, 4))
        kv_strides = (self.stride, shape.position_bytes(),
                      *np.empty(shape.kv_shape, DTYPES[shape.dtype]).strides)
        self.kv = np.ndarray((slots, positions, *shape.kv_shape), DTYPES[shape.dtype], mm,
                             base + 4 * positions, kv_strides)
        self.hidden = np.ndarray((slots, RING, shape.hidden), DTYPES[shape.dtype], mm,
                                 base + 4 * positions + shape.position_bytes() * positions,
                                 (self.stride, item * shape.hidden, item))

    @property
    def size(self) -> int:
        return self.table_bytes + self.slots * self.stride

    @classmethod
    def create(cls, node_dir: Path, slots: int, positions: int, shape: Shape) -> Slab:
        node_dir.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()
        path = node_dir / f"slab-{pid}-{time.monotonic_ns()}.kvs"
        size = _round(_META.size + TABLE.itemsize * slots) + slots * _round(
            4 * positions + shape.position_bytes() * positions
            + RING * DTYPES[shape.dtype].itemsize * shape.hidden)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)   # sparse: pages are node memory only once written
            os.pwrite(fd, _META.pack(MAGIC, slots, positions, shape.layers, shape.heads,
                                     shape.head_dim, shape.hidden, _NAMES.index(shape.dtype),
                                     pid), 0)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, mm, slots, positions, shape, pid)

    @classmethod
    def open(cls, path: Path) -> Slab | None:
        """Map another engine's slab; None if it is gone or not a whole slab."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            head = os.pread(fd, _META.size, 0)
            if len(head) != _META.size:
                return None
            magic, slots, positions, layers, heads, head_dim, hidden, code, pid = \
                _META.unpack(head)
            if magic != MAGIC or not 0 <= code < len(_NAMES):
                return None
            shape = Shape(layers, heads, head_dim, hidden, _NAMES[code])
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        except (OSError, ValueError, struct.error):
            return None
        finally:
            os.close(fd)
        try:
            return cls(path, mm, slots, positions, shape, pid)
        except (TypeError, ValueError):   # too small for what its header says
            mm.close()
            return None

    def free(self, slots: list[int] | np.ndarray, *, punch: bool = True) -> None:
        """Invalidate ``slots``; ``punch`` gives their pages back to the node."""
        for slot in np.asarray(slots, dtype=np.int64).tolist():
            self.table["state"][slot] = 0
            if punch:
                self.punch(slot)

    def punch(self, slot: int) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.mm.madvise(mmap.MADV_REMOVE, self.table_bytes + slot * self.stride,
                            self.stride)

    def used_bytes(self) -> int:
        valid = self.table["state"] == 1
        return int(self.table["covered"][valid].sum()) * self.shape.position_bytes()

    def close(self) -> None:
        # Views into the map must go before it can close; a live one keeps it open.
        for name in ("table", "tokens", "kv", "hidden"):
            self.__dict__.pop(name, None)
        with contextlib.suppress(BufferError):
            self.mm.close()


def _round(n: int) -> int:
    return -(-n // PAGE) * PAGE


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

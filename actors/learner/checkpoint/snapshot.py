"""The part of a checkpoint that training waits for: a snapshot of the learner's tensors,
copied into one shared-memory staging buffer by a background thread while the next step
computes.  :class:`~erlay.actors.learner.checkpoint.AsyncCheckpointer` plans a
:class:`Snapshot` in ``save()`` and runs it on its :class:`Copier` thread, which then hands
the request to nvidia-resiliency-ext's persistent worker to write the files.

Contracts:

- **The barrier.** A snapshot walks the state and copies its tensors *on its own thread,
  after save() has returned*, so the caller must modify neither the tensors (in place) nor
  the state's containers until :meth:`Snapshot.wait` returns
  (:meth:`AsyncCheckpointer.wait_snapshot`, which the learner's optimizer step pre-hook
  calls).  Reading the tensors (forward and backward passes), dropping references to them
  and replacing them with new tensors are all fine.  Only the time the caller spends
  blocked in ``save()`` and at the barrier is exposed; the walk and the copy cost CPU time
  beside training (``cpu_s``).
- **A modified tensor fails the save, it is never written torn.**  Each tensor's version
  counter (``tensor._version``, bumped by every in-place operation through torch, an
  optimizer step included) is recorded when the walk reaches it and checked after the copy;
  a change marks the snapshot failed and the checkpoint is not written.  This is a safety
  net for a caller that skipped the barrier, not a substitute for it: writes through
  ``.data``, numpy views or another process do not bump the counter.
- **The worker sees only finished snapshots.**  The request reaches the worker's queue
  after the copy, from the copy thread, through a pipe: the writes to the buffer happen
  before the worker's reads, and a snapshot that failed, or a trainer that died mid-copy,
  never reaches the worker at all.
- **No fork.**  The snapshot is a thread in the trainer, not a forked child: a learner is a
  Ray actor with gRPC and torch thread pools, which a fork copies in an undefined state,
  and a copy-on-write snapshot's cost moves into the page faults of the next optimizer
  step rather than going away (``docs/recovery.md``).
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from erlay.supervisor.failpoints import failpoint

__all__ = ["Copier", "Snapshot", "StagingBuffer", "unstage"]

# Staged tensors start on cache-line boundaries, which also satisfies every dtype's alignment.
_ALIGN = 64
# The copy goes in chunks so a kill, a failpoint or close() can cut it between two of them;
# 16 MiB keeps the per-chunk overhead (a Python call, a GIL handoff) far below the memcpy.
CHUNK_BYTES = 16 << 20


class Slot(NamedTuple):
    """Where one staged tensor lies in the staging buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


_IMMUTABLE = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_SCALARS = frozenset((bool, int, float, complex, str, bytes, type(None)))
# Where a value lies in a state: None for the root, else (where its container lies, key).
Where = tuple[Any, Any] | None


def describe(where: Where) -> str:
    """``state['model']['w']`` for the place ``where``; built only for error messages, so
    that walking a state costs no string formatting."""
    keys: list[Any] = []
    while where is not None:
        where, key = where
        keys.append(key)
    return "state" + "".join(f"[{k!r}]" for k in reversed(keys))


def rebuild(obj: Any, leaf: Any, where: Where = None) -> Any:
    """``obj`` with its dicts, lists and tuples rebuilt and every other value replaced by
    ``leaf(value, where)``, ``where`` naming the value's place (:func:`describe`)."""
    kind = type(obj)
    if kind is tuple or kind is list:
        # A flat sequence of scalars (the Python RNG's state: 625 ints) is copied whole.
        if all(type(v) in _SCALARS for v in obj):
            return obj if kind is tuple else list(obj)
        return kind(rebuild(v, leaf, (where, i)) for i, v in enumerate(obj))
    if isinstance(obj, dict):
        # Other mappings become dicts: a weights_only load knows only these two.
        cls = kind if kind in (dict, OrderedDict) else dict
        return cls((k, rebuild(v, leaf, (where, k))) for k, v in obj.items())
    return leaf(obj, where)


# (tensor, its slot, where it lies, its version counter when planned)
_Planned = tuple[torch.Tensor, Slot, Where, int]


class StagingBuffer:
    """One shared-memory byte buffer that every snapshot copies its tensors into.

    It grows when a state no longer fits and is otherwise reused, so after the first save the
    copy touches pages that are already mapped.  The checkpointer makes sure the worker has
    finished reading it, and the previous snapshot has finished writing it, before a new
    snapshot starts.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def plan(self, state: Any) -> tuple[Any, list[_Planned]]:
        """Synchronous part of a snapshot: ``state``'s structure with every tensor replaced by
        a :class:`Slot`, and the tensors to copy there.  Other leaves are deep-copied by
        pickling now (so they are known to travel), and should be small.  Grows the buffer
        if needed.  TypeError names a leaf that cannot be checkpointed."""
        planned: list[_Planned] = []
        end = 0

        def leaf(obj: Any, where: Where) -> Any:
            nonlocal end
            if isinstance(obj, torch.Tensor):
                if obj.layout is not torch.strided or obj.is_quantized:
                    raise TypeError(f"{describe(where)}: only dense tensors can be "
                                    f"checkpointed")
                # This runs once per tensor in save(), on the caller's time: kept lean.
                nbytes = obj.nbytes
                slot = Slot(end, nbytes, obj.dtype, obj.shape)
                planned.append((obj, slot, where, obj._version))
                end += (nbytes + _ALIGN - 1) & -_ALIGN
                return slot
            if obj is None or type(obj) in _IMMUTABLE:
                return obj
            try:
                # A leaf that cannot be pickled would otherwise fail in the queue's feeder
                # thread, where nobody sees it, and the save would never finish.
                return pickle.loads(pickle.dumps(obj))
            except Exception as exc:
                raise TypeError(f"{describe(where)}: {type(obj).__name__} cannot be "
                                f"checkpointed: {exc}") from exc

        skeleton = rebuild(state, leaf)
        if self.buffer is None or self.buffer.numel() < end:
            # A new shared segment, mapped but not touched: its pages are faulted in by the
            # first snapshot's copy, in the background, not here.
            storage = torch.UntypedStorage._new_shared(end)
            self.buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
        return skeleton, planned


class Copier:
    """One daemon thread that runs jobs (a snapshot's copy and its hand-over), in order.
    Submitting is a queue put: save() never waits for a thread to start (the first save
    excepted)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="erlay-snapshot",
                                            daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def stop(self) -> None:
        """Finish the queued jobs, then end the thread."""
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._thread = None

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()


class Snapshot:
    """A background copy of one state's tensors into a :class:`StagingBuffer`.

    Construction only takes the state; :meth:`run`, on a :class:`Copier`'s thread, walks it
    (:meth:`StagingBuffer.plan`), copies its tensors and checks them; :meth:`wait` is the
    barrier.  ``error`` is None, or why the snapshot failed; it is set before :attr:`done`
    turns true, and so is ``skeleton`` (the state's structure, tensors replaced by slots).
    """

    def __init__(self, staging: StagingBuffer, state: Any) -> None:
        self._state: Any = state
        self.skeleton: Any = None
        self._planned: list[_Planned] = []
        self.error: str | None = None
        self.copy_s = 0.0   # wall time of the copy, in the background
        self.cpu_s = 0.0    # CPU time the copy thread used: what it costs a saturated host
        self.waited_s = 0.0  # time callers spent blocked in wait()
        self._staging = staging
        self._abort = threading.Event()
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        """True once the copy has finished, successfully or not."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> float:
        """Block until the copy has finished: from then on the caller may modify the state.
        Returns the seconds blocked (0 when it was already done).  TimeoutError when it is
        still copying after ``timeout_s``."""
        if self._done.is_set():
            return 0.0
        started = time.perf_counter()
        finished = self._done.wait(timeout_s)
        blocked = time.perf_counter() - started
        self.waited_s += blocked
        if not finished:
            raise TimeoutError(f"snapshot still copying after {timeout_s} s")
        return blocked

    def abort(self) -> None:
        """Stop the copy at the next chunk and fail the snapshot (a snapshot that has not
        started fails at once when it does)."""
        self._abort.set()

    def run(self) -> None:
        """Copy the tensors into the buffer, then check they were not modified meanwhile;
        sets ``error`` on any failure, then :attr:`done`.  Never raises."""
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            self.skeleton, self._planned = self._staging.plan(self._state)
            self.error = self._copy()
        except TypeError as exc:  # a leaf that cannot be checkpointed (plan names it)
            self.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported as the save's failure
            self.error = f"snapshot failed: {type(exc).__name__}: {exc}"
        finally:
            self.copy_s = time.perf_counter() - started
            self.cpu_s = time.thread_time() - cpu
            self._state, self._planned = None, []  # drop the references to the caller's state
            self._done.set()

    def _copy(self) -> str | None:
        buffer = self._staging.buffer
        assert buffer is not None
        with torch.no_grad():
            for tensor, slot, _, _ in self._planned:
                if slot.nbytes == 0:
                    continue
                target = buffer[slot.offset:slot.offset + slot.nbytes]
                dst = target.view(slot.dtype).view(-1)
                tensor = tensor.detach()
                src = tensor.reshape(-1) if tensor.is_contiguous() else \
                    tensor.contiguous().view(-1)
                per_chunk = max(1, CHUNK_BYTES // max(1, tensor.element_size()))
                for start in range(0, dst.numel(), per_chunk):
                    if self._abort.is_set():
                        return "snapshot aborted"
                    dst[start:start + per_chunk].copy_(src[start:start + per_chunk])
                    # A kill here strikes mid-snapshot: part of the state is staged.
                    failpoint("learner.checkpoint_snapshot")
        for tensor, _, where, version in self._planned:
            if tensor._version != version:
                return (f"{describe(where)} was modified in place while its snapshot "
                        f"was being copied; wait for the snapshot (wait_snapshot()) before "
                        f"modifying a saved state")
        return None


def unstage(skeleton: Any, buffer: torch.Tensor) -> Any:
    """Worker side: the state again, tensors backed by the shared buffer without a copy.

    Each tensor gets its own storage (``torch.frombuffer``), so ``torch.save`` writes one
    record per tensor and the loaded checkpoint holds independent tensors, not views of one
    big storage.
    """
    raw = buffer.numpy()

    def leaf(obj: Any, where: Where) -> Any:
        if not isinstance(obj, Slot):
            return obj
        if obj.nbytes == 0:
            return torch.empty(obj.shape, dtype=obj.dtype)
        chunk = raw[obj.offset:obj.offset + obj.nbytes]
        return torch.frombuffer(chunk, dtype=obj.dtype).view(obj.shape)

    return rebuild(skeleton, leaf)

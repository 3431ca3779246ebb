"""Asynchronous learner checkpoints on nvidia-resiliency-ext's persistent checkpoint worker.

The training loop pays only for handing a state over; writing it to disk happens in the
library's persistent worker process (``AsyncCallsQueue(persistent=True)``), and committing it
happens on a later :meth:`AsyncCheckpointer.poll` or :meth:`AsyncCheckpointer.wait`.

Contracts:

- **Atomic checkpoints.** A checkpoint is complete exactly when ``root/step-XXXXXXXX`` exists
  and holds a valid ``manifest.json`` whose step matches the directory and whose files exist
  with the recorded sizes.  The worker writes into ``root/.tmp-step-XXXXXXXX-<nonce>/``:
  ``state.pt`` (``torch.save``, fsynced), then the manifest (sizes, sha256, ``extra``,
  fsynced), then fsyncs the directory.  Only the trainer, when it finalizes a finished save,
  commits the directory into place and fsyncs ``root``
  (:mod:`~erlay.actors.learner.checkpoint_commit`).  A crash at any point leaves either the
  old set of checkpoints or the old set plus the new one, never a half-written ``step-*``;
  leftover ``.tmp-*`` directories are ignored, and removed when the next checkpointer starts
  on that root.
- **A re-save never loses the step.** Saving a step that already has a checkpoint (a run
  resumed before it) swaps the new directory in and only then removes the old one, so at
  every instant the step has a complete checkpoint, the old or the new: an atomic
  ``renameat2(RENAME_EXCHANGE)`` on Linux, elsewhere two renames with the old directory
  aside (``.old-step-XXXXXXXX-<nonce>``) in between, which readers take for the step while
  its final name is missing and the next checkpointer renames back.
- **What save() costs the caller.** The worker is another process, so tensors reach it
  through shared memory.  :meth:`~AsyncCheckpointer.save` copies every tensor of the state
  into one reusable shared-memory staging buffer (a memcpy into pages that are already
  mapped, after the first save) and enqueues a small request naming it.  Moving a fresh
  tensor into shared memory instead costs ~20x more on these machines (page faults), and a
  tensor per shared segment would spend one file descriptor each.  Because save() copies, the
  caller may mutate or free its state as soon as save() returns; tensors on an accelerator,
  or still attached to autograd, are copied to host memory by the same step.  A caller that
  holds a lock may therefore pass live views (``model.state_dict()``) and skip its own copy.
  The buffer holds one state's worth of shared memory (``/dev/shm``) for the checkpointer's
  lifetime.
- **One save in flight.** The staging buffer is reused, so a save requested while the
  previous one is still being written waits for that one to commit first; the wait is part
  of the seconds save() returns, and it is logged.  Checkpoint more rarely than one write
  takes and save() never waits.
- **Failures.** A save that fails in the worker, or whose worker dies, raises
  :class:`CheckpointSaveFailed` from the next :meth:`~AsyncCheckpointer.poll` or
  :meth:`~AsyncCheckpointer.wait` and leaves no complete checkpoint behind; a dead worker is
  replaced on the next save.  The worker exits within a second of its trainer's death,
  however the trainer died.
- **Rank-local.** Finalization skips the library's cross-rank all-reduce (it needs CUDA), so
  each checkpointer commits on its own.  In a data-parallel learner every rank holds the same
  state: let rank 0 checkpoint, into a root no other checkpointer uses.

The library wants a ``torch.distributed`` group (it asks for the rank).  The first save calls
:func:`ensure_process_group`, which makes a one-process gloo group only when none exists.  A
multi-rank learner must therefore form its own group before its first save (LearnerCore
forms it at the first collective, so: before any train step, do not save).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import secrets
import shutil
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from torch import distributed as dist

from erlay.actors.learner.checkpoint_commit import commit_dir, recover_root
from erlay.actors.learner.checkpoint_format import (
    TMP_PREFIX,
    CheckpointInfo,
    CheckpointInvalid,
    latest,
    list_checkpoints,
    load,
    read_manifest,
    step_dir_name,
    write_checkpoint_dir,
)
from erlay.supervisor.errors import ErlayError
from erlay.supervisor.failpoints import FailpointError

__all__ = ["AsyncCheckpointer", "CheckpointInfo", "CheckpointInvalid", "CheckpointSaveFailed",
           "ensure_process_group", "latest", "list_checkpoints", "load"]

log = logging.getLogger("erlay.checkpoint")

FAILED = "FAILED"
# Staged tensors start on cache-line boundaries, which also satisfies every dtype's alignment.
_ALIGN = 64
_POLL_INTERVAL_S = 0.05
_PARENT_CHECK_S = 1.0


class CheckpointSaveFailed(ErlayError):
    """Persisting the checkpoint of ``step`` failed; no complete checkpoint of it exists."""

    def __init__(self, step: int, reason: str) -> None:
        self.step = step
        self.reason = reason
        super().__init__(f"checkpoint of step {step} failed: {reason}")


# --------------------------------------------------------------------------- the process group
def ensure_process_group() -> bool:
    """Make a one-process gloo group on loopback unless this process already has a group.

    Returns True when it made one (its owner should destroy it when done).  The store is a
    TCPStore on a port the OS picks, so concurrent processes never collide.
    """
    if dist.is_initialized():
        return False
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    log.info("made a one-process gloo group for the checkpoint worker")
    return True


# ------------------------------------------------------------------------------- staging
class _Slot(NamedTuple):
    """Where one staged tensor lies in the staging buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


_IMMUTABLE = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _rebuild(obj: Any, leaf: Any, where: str = "state") -> Any:
    """``obj`` with its dicts, lists and tuples rebuilt and every other value replaced by
    ``leaf(value, where)``, ``where`` naming the value's place for error messages."""
    if isinstance(obj, dict):
        # Other mappings become dicts: a weights_only load knows only these two.
        cls = type(obj) if type(obj) in (dict, OrderedDict) else dict
        return cls((k, _rebuild(v, leaf, f"{where}[{k!r}]")) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_rebuild(v, leaf, f"{where}[{i}]") for i, v in enumerate(obj))
    return leaf(obj, where)


class _StagingBuffer:
    """One shared-memory byte buffer that every save copies its tensors into.

    It grows when a state no longer fits and is otherwise reused, so after the first save the
    copy touches pages that are already mapped.  Not thread-safe; the checkpointer makes sure
    the worker has finished reading it before it is written again.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def stage(self, state: Any) -> Any:
        """A copy of ``state``'s structure with every tensor replaced by a :class:`_Slot`,
        after copying the tensors into the buffer.  Other leaves are deep-copied by pickling
        (so they are known to travel), and should be small.  TypeError names a leaf that
        cannot be checkpointed."""
        staged: list[tuple[torch.Tensor, _Slot]] = []
        end = 0

        def leaf(obj: Any, where: str) -> Any:
            nonlocal end
            if isinstance(obj, torch.Tensor):
                if obj.layout != torch.strided or obj.is_quantized:
                    raise TypeError(f"{where}: only dense tensors can be checkpointed")
                slot = _Slot(end, obj.numel() * obj.element_size(), obj.dtype,
                             tuple(obj.shape))
                staged.append((obj, slot))
                end += -(-slot.nbytes // _ALIGN) * _ALIGN
                return slot
            if obj is None or type(obj) in _IMMUTABLE:
                return obj
            try:
                # A leaf that cannot be pickled would otherwise fail in the queue's feeder
                # thread, where nobody sees it, and the save would never finish.
                return pickle.loads(pickle.dumps(obj))
            except Exception as exc:
                raise TypeError(f"{where}: {type(obj).__name__} cannot be checkpointed: "
                                f"{exc}") from exc

        skeleton = _rebuild(state, leaf)
        if self.buffer is None or self.buffer.numel() < end:
            # share_memory_ of a fresh tensor faults every page in now, once, instead of on
            # each later save.
            self.buffer = torch.empty(max(end, _ALIGN), dtype=torch.uint8).share_memory_()
        with torch.no_grad():
            for tensor, slot in staged:
                if slot.nbytes:
                    target = self.buffer[slot.offset:slot.offset + slot.nbytes]
                    target.view(slot.dtype).view(slot.shape).copy_(tensor)
        return skeleton


def _unstage(skeleton: Any, buffer: torch.Tensor) -> Any:
    """Worker side: the state again, tensors backed by the shared buffer without a copy.

    Each tensor gets its own storage (``torch.frombuffer``), so ``torch.save`` writes one
    record per tensor and the loaded checkpoint holds independent tensors, not views of one
    big storage.
    """
    raw = buffer.numpy()

    def leaf(obj: Any, where: str) -> Any:
        if not isinstance(obj, _Slot):
            return obj
        if obj.nbytes == 0:
            return torch.empty(obj.shape, dtype=obj.dtype)
        chunk = raw[obj.offset:obj.offset + obj.nbytes]
        return torch.frombuffer(chunk, dtype=obj.dtype).view(obj.shape)

    return _rebuild(skeleton, leaf)


# ------------------------------------------------------------------- the worker's side
_watched_parent: int | None = None


def _exit_with_parent(parent: int) -> None:
    """Make this worker exit once ``parent`` (the trainer) is gone.

    The library's worker would otherwise outlive a trainer killed with SIGKILL, blocked for
    ever on a queue it holds both ends of.  A thread that watches the parent pid is used
    rather than PR_SET_PDEATHSIG, which fires when the *thread* that started the worker
    exits, not the process.  A save the parent never sees committed may be cut short: its
    ``.tmp-`` directory is removed by the next checkpointer on that root.
    """
    global _watched_parent
    if _watched_parent is not None or parent == os.getpid():
        return  # already watching, or running in the trainer itself
    _watched_parent = parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="erlay-checkpoint-parent-watch", daemon=True).start()


def _persist(tmp_dir: str, skeleton: Any, buffer: torch.Tensor, step: int,
             extra: dict[str, Any], parent: int, write_delay_s: float = 0.0) -> None:
    """Runs in the library's persistent worker: write the checkpoint into ``tmp_dir``.

    Never raises.  An exception escaping here would kill the worker loop before it reports
    completion, and the trainer would wait forever; instead a ``FAILED`` file with the
    traceback tells the trainer's finalization what went wrong.  ``parent`` is the trainer's
    pid (see :func:`_exit_with_parent`).
    """
    _exit_with_parent(parent)
    tmp = Path(tmp_dir)
    if write_delay_s > 0:  # slow storage, as the chaos suite injects it
        time.sleep(write_delay_s)
    try:
        write_checkpoint_dir(tmp, step, _unstage(skeleton, buffer), extra)
    except Exception:  # noqa: BLE001 - reported through the FAILED file, see above
        try:
            (tmp / FAILED).write_text(traceback.format_exc())
        except OSError:
            pass  # finalization also fails a save that left no manifest


def _release_queues(caller: Any, *, flush: bool) -> None:
    """Close the library's queues, which it leaves open: their feeder threads would keep
    their semaphores alive until the process exits.  Without ``flush`` (the reader is dead)
    nothing waits for unsent data."""
    for queue in (caller.queue, caller.preload_q, caller.comp_q):
        if not flush:
            queue.cancel_join_thread()
        queue.close()
        if flush:
            queue.join_thread()


# ------------------------------------------------------------------------ the checkpointer
@dataclass
class _InFlight:
    step: int
    tmp: Path
    started: float


class AsyncCheckpointer:
    """Saves learner states under ``root`` in the background, keeping the newest ``keep``.

    See the module docstring for the contracts.  Methods are meant for one thread (the
    training loop).  Construction puts ``root`` back in order after a crash
    (:func:`~erlay.actors.learner.checkpoint_commit.recover_root`: leftovers removed, an
    interrupted re-save's old checkpoint renamed back), so only one checkpointer may use a
    root at a time.
    """

    def __init__(self, root: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)
        recover_root(self.root)
        self._calls: AsyncCallsQueue | None = None
        self._staging = _StagingBuffer()
        self._inflight: _InFlight | None = None
        self._failure: CheckpointSaveFailed | None = None
        self._unreported: list[int] = []  # committed while save() waited
        self._owns_group = False
        self._closed = False

    # ------------------------------------------------------------------------ public API
    @property
    def worker_pid(self) -> int | None:
        """The pid of the persistent worker process, once a save has started it."""
        caller = self._calls.persistent_caller if self._calls is not None else None
        process = getattr(caller, "process", None)
        return process.pid if process is not None else None

    @property
    def in_flight(self) -> int | None:
        """The step being written, or None."""
        return self._inflight.step if self._inflight is not None else None

    def save(self, step: int, state: dict[str, Any],
             extra: dict[str, Any] | None = None, *, write_delay_s: float = 0.0) -> float:
        """Start saving ``state`` as the checkpoint of ``step``; returns the seconds the
        caller was blocked (waiting for a save in flight, staging, enqueueing).

        ``extra`` is small JSON-able metadata stored in the manifest.  The state is copied
        before save() returns (module docstring).  Raises ValueError or TypeError for a
        state or ``extra`` that cannot be checkpointed, at once, before anything is queued.
        If the save it waited for failed, the next poll() or wait() raises that failure.
        """
        started = time.perf_counter()
        if self._closed:
            raise RuntimeError("this checkpointer is closed")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        extra = json.loads(json.dumps(extra or {}))  # fails now, not in the worker
        if self._inflight is not None:
            waited_for = self._inflight.step
            try:
                self._unreported += self._drain(timeout_s=None)
            except CheckpointSaveFailed as exc:
                self._remember(exc)
            log.info("save of step %d waited %.2f s for step %d to commit", step,
                     time.perf_counter() - started, waited_for)
        self._owns_group = ensure_process_group() or self._owns_group
        skeleton = self._staging.stage(state)
        tmp = self.root / f"{TMP_PREFIX}{step_dir_name(step)}-{secrets.token_hex(4)}"
        request = AsyncRequest(async_fn=_persist,
                               async_fn_args=(str(tmp), skeleton, self._staging.buffer, step,
                                              extra, os.getpid(), write_delay_s),
                               finalize_fns=[partial(self._commit, step, tmp)])
        if self._calls is None:
            self._calls = AsyncCallsQueue(persistent=True)
        self._calls.schedule_async_request(request)
        self._inflight = _InFlight(step, tmp, time.monotonic())
        return time.perf_counter() - started

    def poll(self) -> list[int]:
        """Commit a save the worker has finished, without blocking; returns the steps
        committed since the last poll or wait, oldest first.  Raises
        :class:`CheckpointSaveFailed` for a failed save."""
        self._raise_remembered()
        self._unreported += self._advance()
        steps, self._unreported = self._unreported, []
        return steps

    def wait(self, timeout_s: float | None = None) -> list[int]:
        """Block until no save is in flight; returns the steps committed meanwhile.

        Raises :class:`CheckpointSaveFailed` for a failed save and TimeoutError when the save
        in flight has not finished after ``timeout_s`` (it stays in flight).
        """
        self._raise_remembered()
        self._unreported += self._drain(timeout_s)
        steps, self._unreported = self._unreported, []
        return steps

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the save in flight, then stop the worker.

        After ``timeout_s`` the worker is killed instead and the save fails.  Raises
        :class:`CheckpointSaveFailed` if the last save failed; the worker is stopped either
        way, and so is the process group if :func:`ensure_process_group` made it here.
        """
        if self._closed:
            return
        try:
            self.wait(timeout_s)
        except TimeoutError:
            self._worker_lost("did not finish before close", kill=True)
        finally:
            self._closed = True
            self._stop_worker()
            self._staging = _StagingBuffer()
            if self._owns_group and dist.is_initialized():
                dist.destroy_process_group()
            self._owns_group = False

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Never closed: the library's own finalizer stops a live worker, but it waits for
        # ever on the queue of a dead one, which would hang this process's exit.
        if getattr(self, "_calls", None) is not None and not self._worker_alive():
            self._calls.persistent_caller.process = None  # type: ignore[union-attr]

    # ------------------------------------------------------------------------- internals
    def _advance(self) -> list[int]:
        if self._inflight is None or self._calls is None:
            return []
        inflight = self._inflight
        try:
            done = self._calls.maybe_finalize_async_calls(blocking=False, no_dist=True)
            if not done and not self._worker_alive():
                # Look once more: the worker may have reported completion and then exited.
                done = self._calls.maybe_finalize_async_calls(blocking=False, no_dist=True)
                if not done:
                    self._worker_lost("died")
        except CheckpointSaveFailed:
            self._inflight = None
            raise
        if not done:
            return []
        self._inflight = None
        log.info("checkpoint of step %d committed after %.2f s", inflight.step,
                 time.monotonic() - inflight.started)
        return [inflight.step]

    def _drain(self, timeout_s: float | None) -> list[int]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        committed: list[int] = []
        while self._inflight is not None:
            committed += self._advance()
            if self._inflight is None:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"checkpoint of step {self._inflight.step} still in "
                                   f"flight after {timeout_s} s")
            time.sleep(_POLL_INTERVAL_S)
        return committed

    def _commit(self, step: int, tmp: Path) -> None:
        """Finalization, run by the library in this process once the worker is done:
        commit the finished directory into place (:func:`commit_dir`), then apply
        retention.  Any failure, a commit failpoint's ``raise`` included, is a
        :class:`CheckpointSaveFailed` (the library has already dropped the request, so
        anything else would leave this checkpointer waiting for it) and removes ``tmp``."""
        try:
            if (tmp / FAILED).exists():
                raise CheckpointSaveFailed(
                    step, (tmp / FAILED).read_text().strip().splitlines()[-1])
            try:
                read_manifest(tmp, step)
            except CheckpointInvalid as exc:
                raise CheckpointSaveFailed(step, exc.reason) from exc
            # A step saved again (a run resumed before it) replaces its old checkpoint.
            commit_dir(tmp, self.root / step_dir_name(step))
        except (OSError, FailpointError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointSaveFailed(step, f"finalizing failed: {exc}") from exc
        except CheckpointSaveFailed:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in list_checkpoints(self.root)[:-self.keep]:
            log.info("removing checkpoint %s (keeping %d)", old.path, self.keep)
            shutil.rmtree(old.path, ignore_errors=True)

    def _worker_alive(self) -> bool:
        caller = self._calls.persistent_caller if self._calls is not None else None
        process = getattr(caller, "process", None)
        return process is not None and process.is_alive()

    def _worker_lost(self, how: str, *, kill: bool = False) -> None:
        """Give up on the worker and the save in flight; the next save starts a new one."""
        assert self._calls is not None and self._inflight is not None
        caller = self._calls.persistent_caller
        process = caller.process
        if kill and process is not None:
            process.kill()
            process.join()
        # The library's close() would wait forever on a queue nobody reads, and so would the
        # queues' feeder threads at interpreter exit.
        caller.process = None
        _release_queues(caller, flush=False)
        self._calls = None
        step, tmp = self._inflight.step, self._inflight.tmp
        self._inflight = None
        shutil.rmtree(tmp, ignore_errors=True)
        code = process.exitcode if process is not None else None
        raise CheckpointSaveFailed(step, f"checkpoint worker {how} (exit code {code})")

    def _stop_worker(self) -> None:
        if self._calls is None:
            return
        caller = self._calls.persistent_caller
        if caller is not None:
            alive = self._worker_alive()
            if alive:
                caller.close()  # tells the worker to exit and joins it
            caller.process = None
            _release_queues(caller, flush=alive)
        self._calls = None

    def _remember(self, exc: CheckpointSaveFailed) -> None:
        if self._failure is None:
            self._failure = exc
        else:
            log.error("another checkpoint failure before the first was reported: %s", exc)

    def _raise_remembered(self) -> None:
        if self._failure is not None:
            exc, self._failure = self._failure, None
            raise exc

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
  (:mod:`~erlay.actors.learner.checkpoint.commit`).  A crash at any point leaves either the
  old set of checkpoints or the old set plus the new one, never a half-written ``step-*``;
  leftover ``.tmp-*`` directories are ignored, and removed when the next checkpointer starts
  on that root.
- **A re-save never loses the step.** Saving a step that already has a checkpoint (a run
  resumed before it) swaps the new directory in and only then removes the old one, so at
  every instant the step has a complete checkpoint, the old or the new: an atomic
  ``renameat2(RENAME_EXCHANGE)`` on Linux, elsewhere two renames with the old directory
  aside (``.old-step-XXXXXXXX-<nonce>``) in between, which readers take for the step while
  its final name is missing and the next checkpointer renames back.
- **What save() costs the caller, and the barrier.** The worker is another process, so
  tensors reach it through one reusable shared-memory staging buffer.
  :meth:`~AsyncCheckpointer.save` hands the state to a background
  :class:`~erlay.actors.learner.checkpoint.snapshot.Snapshot` and returns; on its own thread the
  snapshot walks the state, copies its tensors into the buffer and only then queues the
  request for the worker.  The caller may read the state's tensors at once, and drop or
  replace them, but must modify neither them (in place) nor the state's containers before
  :meth:`~AsyncCheckpointer.wait_snapshot` returns; :meth:`~AsyncCheckpointer.guard` makes
  an optimizer's ``step()`` wait there, so the copy overlaps the next step's forward and
  backward passes.  A tensor modified while it is copied fails the save
  (:mod:`~erlay.actors.learner.checkpoint.snapshot`), it is never written torn.  The exposed time is
  save()'s return plus any wait at the barrier.  A caller that holds a lock may pass live
  views (``model.state_dict()``) and skip its own copy.  Tensors on an accelerator are
  copied to host memory by the snapshot.  The buffer holds one state's worth of shared
  memory (``/dev/shm``) for the checkpointer's lifetime.
- **One save in flight.** The staging buffer is reused, so a save requested while the
  previous one is still being written waits for that one to commit first; the wait is part
  of the seconds save() returns, and it is logged.  Checkpoint more rarely than one write
  takes and save() never waits.
- **Failures.** A save that fails in its snapshot or in the worker, or whose worker dies,
  raises :class:`CheckpointSaveFailed` from the next :meth:`~AsyncCheckpointer.poll` or
  :meth:`~AsyncCheckpointer.wait` and leaves no complete checkpoint behind; a dead worker is
  replaced on the next save.  The worker exits within a second of its trainer's death,
  however the trainer died (unless it is stopped: see below).
- **A deadline on the write.** A worker that makes no progress on the save it holds for
  ``deadline_s`` (SIGSTOPped, in D state on a hung filesystem, blocked) is killed and the
  save fails with a reason that names the deadline; its ``.tmp-`` directory is removed, the
  previous committed checkpoint stays, and the next save starts a new worker.  Progress is
  measured from the worker's own counters (:mod:`~erlay.actors.learner.checkpoint.worker`),
  at each poll and every 50 ms of a wait, so nothing that waits for a save (a save behind
  it, wait(), close()) waits on a stuck worker much past its deadline.  close() stops an
  idle worker politely for at most a few seconds (never more than the deadline), then
  kills it.
- **Rank-local.** Finalization skips the library's cross-rank all-reduce (it needs CUDA), so
  each checkpointer commits on its own.  In a data-parallel learner every rank holds the same
  state: let rank 0 checkpoint, into a root no other checkpointer uses.

The library wants a ``torch.distributed`` group (it asks for the rank).  The first save calls
:func:`ensure_process_group`, which makes a one-process gloo group only when none exists.  A
multi-rank learner must therefore form its own group before its first save (LearnerCore
forms it at the first collective, so: before any train step, do not save).

The room: this module is the replicated learner's checkpointer and the retention; the on-disk
format and verification are :mod:`.format`, the atomic commit :mod:`.commit`, the copy into
shared memory :mod:`.snapshot`, the worker's calls :mod:`.worker`, sharded (fsdp2) saves and
loads :mod:`.sharded` and :mod:`.sharded_load`.

May import: erlay.supervisor, erlay.actors.model, erlay.actors.learner.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from torch import distributed as dist

from erlay.actors.learner.checkpoint.commit import commit_dir, recover_root, retire
from erlay.actors.learner.checkpoint.format import (
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
from erlay.actors.learner.checkpoint.snapshot import Copier, Snapshot, StagingBuffer, unstage
from erlay.actors.learner.checkpoint.worker import (
    ProgressDeadline,
    kill_worker,
    release_queues,
    stop_worker,
    why_lost,
)
from erlay.supervisor import failpoints
from erlay.supervisor.errors import ErlayError
from erlay.supervisor.failpoints import FailpointError

__all__ = ["AsyncCheckpointer", "CheckpointInfo", "CheckpointInvalid", "CheckpointSaveFailed",
           "FailedSaves", "ensure_process_group", "latest", "list_checkpoints", "load"]

log = logging.getLogger("erlay.checkpoint")

FAILED = "FAILED"
_POLL_INTERVAL_S = 0.05
_PARENT_CHECK_S = 1.0
DEFAULT_DEADLINE_S = 300.0  # checkpoint.deadline_s's default
# How long close() lets an idle worker exit politely, and a killed one die, at most.
_STOP_GRACE_S = 5.0


class CheckpointSaveFailed(ErlayError):
    """Persisting the checkpoint of ``step`` failed; no complete checkpoint of it exists."""

    def __init__(self, step: int, reason: str) -> None:
        self.step = step
        self.reason = reason
        super().__init__(f"checkpoint of step {step} failed: {reason}")


class FailedSaves:
    """The saves that failed since a learner last answered its caller, as ``{"step": N,
    "reason": "..."}`` records: a failed save is news for the coordinator, not a crash of the
    learner, which trains on with its previous committed checkpoint standing.

    >>> answers = [CheckpointSaveFailed(4, "checkpoint worker died (exit code 1)"), [5]]
    >>> def poll() -> list[int]:  # a checkpointer's: step 4 failed, then 5 committed
    ...     answer = answers.pop(0)
    ...     if isinstance(answer, CheckpointSaveFailed):
    ...         raise answer
    ...     return answer
    >>> failed = FailedSaves()
    >>> failed.settle(poll)
    [5]
    >>> failed.take()
    [{'step': 4, 'reason': 'checkpoint worker died (exit code 1)'}]
    >>> failed.take()
    []
    """

    # A checkpointer raises one failure per call, and at most two are pending at a time:
    # one remembered while a save waited, and the save in flight.
    _PENDING_AT_MOST = 2

    def __init__(self) -> None:
        self._records: list[dict[str, Any]] = []

    def settle(self, call: Callable[[], list[int]]) -> list[int]:
        """Run ``call`` (a checkpointer's poll() or wait()) until it raises no
        :class:`CheckpointSaveFailed`, recording each one it raises; returns the steps it
        committed.  Anything else it raises propagates."""
        for _ in range(self._PENDING_AT_MOST):
            try:
                return list(call())
            except CheckpointSaveFailed as exc:
                self.record(exc)
        try:
            return list(call())
        except CheckpointSaveFailed as exc:  # not expected: recorded all the same
            self.record(exc)
            return []

    def record(self, exc: CheckpointSaveFailed) -> None:
        """Record one failed save (and log it)."""
        log.error("%s; the previous committed checkpoint stands", exc)
        self._records.append({"step": exc.step, "reason": exc.reason})

    def take(self) -> list[dict[str, Any]]:
        """The records since the last take(), oldest first; forgets them."""
        records, self._records = self._records, []
        return records


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
    """Runs in the library's persistent worker: write the checkpoint of the snapshot staged
    in ``buffer`` into ``tmp_dir``.

    Never raises.  An exception escaping here would kill the worker loop before it reports
    completion, and the trainer would wait forever; instead a ``FAILED`` file with the
    traceback tells the trainer's finalization what went wrong.  ``parent`` is the trainer's
    pid (see :func:`_exit_with_parent`).
    """
    _exit_with_parent(parent)
    tmp = Path(tmp_dir)
    if write_delay_s > 0:
        # Slow storage, as the chaos suite injects it: the write stalls once its first chunk
        # is in state.pt, so a fault aimed at the writer meanwhile strikes mid-write.
        failpoints.arm("learner.checkpoint_write", "delay", delay_s=write_delay_s, nth=1)
    try:
        write_checkpoint_dir(tmp, step, unstage(skeleton, buffer), extra)
    except Exception:  # noqa: BLE001 - reported through the FAILED file, see above
        try:
            (tmp / FAILED).write_text(traceback.format_exc())
        except OSError:
            pass  # finalization also fails a save that left no manifest


# ------------------------------------------------------------------------ the checkpointer
@dataclass
class _InFlight:
    """A save from save() to its commit.  Until ``handed_over`` is set, the copy thread
    owns the hand-over to the worker (and ``AsyncCheckpointer._calls``); the trainer's
    thread touches neither before then."""

    step: int
    tmp: Path
    started: float
    snapshot: Snapshot
    watch: ProgressDeadline
    handed_over: threading.Event = field(default_factory=threading.Event)
    handover_error: str | None = None


class AsyncCheckpointer:
    """Saves learner states under ``root`` in the background, keeping the newest ``keep``.

    See the module docstring for the contracts.  Methods are meant for one thread (the
    training loop).  Construction puts ``root`` back in order after a crash
    (:func:`~erlay.actors.learner.checkpoint.commit.recover_root`: leftovers removed, an
    interrupted re-save's old checkpoint renamed back), so only one checkpointer may use a
    root at a time.  ``deadline_s`` is the write's progress deadline (``checkpoint.deadline_s``).
    """

    def __init__(self, root: Path, keep: int = 3, *,
                 deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.root = Path(root)
        self.keep = keep
        self.deadline_s = deadline_s
        self.root.mkdir(parents=True, exist_ok=True)
        recover_root(self.root)
        newest = latest(self.root)
        self._committed = newest.step if newest is not None else None
        self._calls: AsyncCallsQueue | None = None
        self._staging = StagingBuffer()
        self._snapshot: Snapshot | None = None  # the newest save's
        self._copier = Copier()
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
    def committed(self) -> int | None:
        """The newest committed step under ``root``, or None; kept current by this
        checkpointer's commits, so reading it costs no look at the disk."""
        return self._committed

    @property
    def in_flight(self) -> int | None:
        """The step being written, or None."""
        return self._inflight.step if self._inflight is not None else None

    @property
    def writer(self) -> tuple[int, int] | None:
        """``(step, pid)`` while the worker process ``pid`` holds the save of ``step`` (handed
        over, not yet finalized by a poll), else None."""
        inflight, pid = self._inflight, self.worker_pid
        if inflight is None or pid is None or not inflight.handed_over.is_set():
            return None
        return inflight.step, pid

    @property
    def last_snapshot(self) -> Snapshot | None:
        """The newest save's snapshot (its timings: ``copy_s``, ``cpu_s``, ``waited_s``)."""
        return self._snapshot

    def save(self, step: int, state: dict[str, Any],
             extra: dict[str, Any] | None = None, *, write_delay_s: float = 0.0) -> float:
        """Start saving ``state`` as the checkpoint of ``step``; returns the seconds the
        caller was blocked here (waiting for a save in flight, handing the state to the
        snapshot's thread).

        ``extra`` is small JSON-able metadata stored in the manifest; ValueError or
        TypeError for one that is not, at once.  The state is walked and its tensors copied
        in the background: modify neither its tensors nor its containers before
        :meth:`wait_snapshot` returns (module docstring).  A state that cannot be
        checkpointed (a leaf that does not pickle, a sparse tensor) fails the save: the next
        poll() or wait() raises :class:`CheckpointSaveFailed` naming the leaf, and nothing
        reaches the worker.  If the save it waited for failed, the next poll() or wait()
        raises that failure.
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
        # The buffer is reused: never while a copy into it may still run.
        self.wait_snapshot()
        self._owns_group = ensure_process_group() or self._owns_group
        snapshot = Snapshot(self._staging, state)
        self._snapshot = snapshot
        tmp = self.root / f"{TMP_PREFIX}{step_dir_name(step)}-{secrets.token_hex(4)}"
        inflight = _InFlight(step, tmp, time.monotonic(), snapshot,
                             ProgressDeadline(self.deadline_s))
        self._inflight = inflight
        self._copier.submit(partial(self._snapshot_and_hand_over, inflight, extra,
                                    write_delay_s))
        return time.perf_counter() - started

    def wait_snapshot(self, timeout_s: float | None = None) -> float:
        """The barrier: block until the newest save's snapshot has copied its tensors, after
        which the caller may modify the state it saved.  Returns the seconds blocked (0 when
        the copy was already done), exposed time like save()'s own.  Never raises a save's
        failure (poll() and wait() do); TimeoutError after ``timeout_s``."""
        if self._snapshot is None:
            return 0.0
        return self._snapshot.wait(timeout_s)

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make every ``optimizer.step()`` first wait for the snapshot (:meth:`wait_snapshot`),
        so a training loop that saves between steps needs no other change; a wait longer than
        a millisecond is logged.  Returns the hook's handle (``.remove()`` undoes it)."""
        def before_step(*_: Any) -> None:
            waited = self.wait_snapshot()
            if waited > 0.001:  # exposed time that save()'s own figure does not include
                log.info("optimizer step waited %.3f s for the checkpoint snapshot", waited)
        return optimizer.register_step_pre_hook(before_step)

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

        Raises :class:`CheckpointSaveFailed` for a failed save, one whose worker made no
        progress for ``deadline_s`` included (so this never waits on a stuck worker much
        longer), and TimeoutError when the save in flight has not finished after
        ``timeout_s`` (it stays in flight).
        """
        self._raise_remembered()
        self._unreported += self._drain(timeout_s)
        steps, self._unreported = self._unreported, []
        return steps

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the save in flight, then stop the worker.

        After ``timeout_s``, or once the worker has made no progress for ``deadline_s``, the
        worker is killed instead and the save fails.  Raises :class:`CheckpointSaveFailed` if
        the last save failed; the worker is stopped either way (an idle one that does not
        exit within a few seconds is killed), and so is the process group if
        :func:`ensure_process_group` made it here.
        """
        if self._closed:
            return
        try:
            self.wait(timeout_s)
        except TimeoutError:
            assert self._inflight is not None
            self._inflight.snapshot.abort()
            self._inflight.handed_over.wait()  # the copy thread is done with the save
            if self._calls is not None:
                self._worker_lost("did not finish before close", kill=True)
            else:  # the first save never reached a worker
                step, self._inflight = self._inflight.step, None
                raise CheckpointSaveFailed(step, "snapshot aborted by close") from None
        finally:
            self._closed = True
            if self._snapshot is not None:
                self._snapshot.abort()  # nothing left to copy for
            self._copier.stop()
            self._stop_worker()
            self._staging = StagingBuffer()
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
    def _snapshot_and_hand_over(self, inflight: _InFlight, extra: dict[str, Any],
                                write_delay_s: float) -> None:
        """On the copy thread: copy the state, then (only if the copy is whole) queue the
        request for the worker, starting the worker on the first save."""
        try:
            snapshot = inflight.snapshot
            snapshot.run()
            if snapshot.error is None:
                step, tmp = inflight.step, inflight.tmp
                request = AsyncRequest(
                    async_fn=_persist,
                    async_fn_args=(str(tmp), snapshot.skeleton, self._staging.buffer, step,
                                   extra, os.getpid(), write_delay_s),
                    finalize_fns=[partial(self._commit, step, tmp)])
                if self._calls is None:
                    self._calls = AsyncCallsQueue(persistent=True)
                self._calls.schedule_async_request(request)
        except Exception as exc:  # noqa: BLE001 - reported by the trainer's next poll
            inflight.handover_error = f"handing the save to the worker failed: {exc}"
        finally:
            inflight.handed_over.set()

    def _advance(self) -> list[int]:
        inflight = self._inflight
        if inflight is None or not inflight.handed_over.is_set():
            return []
        reason = inflight.snapshot.error or inflight.handover_error
        if reason is not None:  # nothing reached the worker
            self._inflight = None
            shutil.rmtree(inflight.tmp, ignore_errors=True)
            raise CheckpointSaveFailed(inflight.step, reason)
        assert self._calls is not None
        try:
            done = self._calls.maybe_finalize_async_calls(blocking=False, no_dist=True)
            lost = None if done else why_lost(self._calls.persistent_caller,
                                              inflight.watch, inflight.tmp, time.monotonic())
            if lost is not None:
                # Look once more: the worker may have reported completion meanwhile.
                done = self._calls.maybe_finalize_async_calls(blocking=False, no_dist=True)
                if not done:
                    self._worker_lost(lost, kill=lost != "died")
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
        retention (:meth:`_retire`).  Any failure, a commit failpoint's ``raise`` included,
        is a :class:`CheckpointSaveFailed` (the library has already dropped the request, so
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
            self._committed = max(step, self._committed or 0)
        except (OSError, FailpointError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointSaveFailed(step, f"finalizing failed: {exc}") from exc
        except CheckpointSaveFailed:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._retire()

    def _retire(self) -> None:
        """Remove all but the newest ``keep`` checkpoints.  Each is first renamed to a
        ``.tmp-retired-`` name, atomically, so a crash mid-removal leaves a leftover that
        the next checkpointer removes, never a half-deleted ``step-*`` directory."""
        retire(self.root, self.keep)

    def _worker_alive(self) -> bool:
        caller = self._calls.persistent_caller if self._calls is not None else None
        process = getattr(caller, "process", None)
        return process is not None and process.is_alive()

    def _worker_lost(self, how: str, *, kill: bool = False) -> None:
        """Give up on the worker and the save in flight; the next save starts a new one."""
        assert self._calls is not None and self._inflight is not None
        caller = self._calls.persistent_caller
        process = caller.process
        if kill:
            code = kill_worker(caller, min(self.deadline_s, _STOP_GRACE_S))
        else:
            # The library's close() would wait forever on a queue nobody reads, and so would
            # the queues' feeder threads at interpreter exit.
            caller.process = None
            release_queues(caller, flush=False)
            code = process.exitcode if process is not None else None
        self._calls = None
        step, tmp = self._inflight.step, self._inflight.tmp
        self._inflight = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveFailed(step, f"checkpoint worker {how} (exit code {code})")

    def _stop_worker(self) -> None:
        if self._calls is None:
            return
        caller = self._calls.persistent_caller
        if caller is not None:
            stop_worker(caller, min(self.deadline_s, _STOP_GRACE_S))
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

"""Sharded asynchronous learner checkpoints: ``torch.distributed.checkpoint`` (DCP) written by
nvidia-resiliency-ext's persistent checkpoint worker, one per rank, with the crash safety of
:mod:`erlay.actors.learner.checkpoint`.

**What is saved.** ``app_state`` is a dict with

- ``"model"`` and ``"optimizer"``: DCP-able state dicts, as
  ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` returns them
  (DTensor shards under FSDP2, plain tensors on one rank).  They are saved with DCP, so they
  load back on any rank count (:func:`load_sharded`).
- any other keys ("plain" entries; the learner's are ``"step"``, ``"version"``,
  ``"warm_started"``, ``"rng"``, ``"model_config"``, ``"format"``): picklable values that
  ``torch.load(weights_only=True)`` reads back (ints, strings, tensors, dicts, lists, tuples).
  Each rank writes its own as ``rank-XXXXX.pt``; ``"rng"`` is per rank, everything else is
  taken from rank 0's file on load.

``extra`` is small JSON metadata (journal snapshot, data position) stored in the manifest.

**Where and in what order** (the stages a kill test strikes):

1. ``save()``, on every rank of the default group, at the same step: one all-reduce over the
   checkpoint's own gloo group agrees on rank 0's nonce for ``root/.tmp-step-XXXXXXXX-<nonce>``
   and on whether any rank's state layout (keys, dtypes, global and local shapes) changed; DCP
   plans the save (a gather and a scatter over that group) on the first two saves and after
   a layout change, and otherwise NVRx's plan cache (``CheckpointMetadataCache``) reuses the
   plan without a collective.  NVRx's ``FileSystemWriterAsync`` turns the plan into this
   rank's write bucket, and a background :class:`~erlay.actors.learner.checkpoint.snapshot.Snapshot`
   copies the bucket's tensors into a shared-memory staging buffer, then queues the write for
   the rank's persistent worker (``AsyncCallsQueue(persistent=True)``).  save() returns
   after planning.
2. The worker writes ``__<rank>_0.distcp`` (NVRx's ``write_preloaded_data``, fsynced) and
   ``rank-XXXXX.pt``, hashes both, then publishes its DCP write results and the files' sizes
   and sha256 in ``.rank-XXXXX.results`` (renamed into place).  Any failure leaves
   ``.rank-XXXXX.failed`` instead (failpoint ``learner.checkpoint_write``: a shard written,
   not reported yet).
3. ``poll()``, on every rank at the same points: one all-reduce over the checkpoint group
   says whether every rank's worker is done and whether any failed.  Only then (all done, none
   failed) the results are gathered to rank 0, which writes DCP's ``.metadata`` (fsynced),
   then ``manifest.json`` (files, sizes, sha256, ``extra``, ``"layout": "sharded"``,
   ``world_size``; failpoint ``learner.checkpoint_manifest`` just before), fsyncs the
   directory and commits it with :func:`~erlay.actors.learner.checkpoint.commit.commit_dir`,
   then keeps the newest ``keep`` (:func:`~erlay.actors.learner.checkpoint.commit.retire`).
   Rank 0 broadcasts the outcome, so every rank returns the same steps or raises the same
   :class:`~erlay.actors.learner.checkpoint.CheckpointSaveFailed`.

A crash at any point leaves the old set of checkpoints or the old set plus the new one, never
a half-written ``step-*``: nothing is named ``step-*`` before the manifest is complete, and a
manifest is written only once every rank's files are fsynced.  Leftover ``.tmp-*``
directories are ignored by readers and removed when the next checkpointer starts (rank 0).

**Why a gloo group of its own.** The save's collectives (nonce, plan, done-agreement, result
gather, outcome) run on the training thread, at save() and poll(), interleaved with training
collectives; a dedicated gloo group keeps them on the CPU (the default group may be NCCL) and
out of the training group's sequence (:func:`~erlay.actors.learner.checkpoint.sharded_load.
checkpoint_group`).  Nothing runs collectives from a background thread.

**The barrier.** As with the replicated checkpointer: after save() returns, modify neither
the saved tensors (in place) nor the containers before :meth:`ShardedCheckpointer.
wait_snapshot` returns; :meth:`ShardedCheckpointer.guard` makes ``optimizer.step()`` wait
there.  A tensor modified during its copy fails the save, it is never written torn.  The
exposed time is save()'s return (agreement, planning) plus any wait at the barrier.

**A rank that dies mid-save** (its trainer) leaves the survivors blocked in the next
checkpoint collective until gloo reports the lost peer or the group's timeout (``timeout_s``)
ends it; the learner's ``one_for_all``
supervision restarts all ranks first, and the new incarnation's rank 0 removes the ``.tmp-``
directory.  A *worker* that dies fails the save on every rank at the next agreement; the next
save starts a new worker.

**A worker that makes no progress** on its rank's part for ``deadline_s`` (SIGSTOPped, in D
state, blocked: measured from its own counters, :mod:`~erlay.actors.learner.checkpoint.worker`)
is killed by its rank, which then votes the save failed: every rank raises the same
:class:`~erlay.actors.learner.checkpoint.CheckpointSaveFailed` at that agreement, rank 0
removes the ``.tmp-`` directory, and the next save starts a new worker on that rank.  So no
poll, wait or close waits on a stuck worker much past the deadline.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import queue
import secrets
import shutil
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
    FileSystemWriterAsync,
)
from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_plan,
)
from torch import distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.tensor import DTensor

from erlay.actors.learner.checkpoint import (
    DEFAULT_DEADLINE_S,
    CheckpointSaveFailed,
    _exit_with_parent,
    ensure_process_group,
)
from erlay.actors.learner.checkpoint.commit import commit_dir, recover_root, retire
from erlay.actors.learner.checkpoint.format import (
    CHECKPOINT_FORMAT,
    DCP_METADATA,
    MANIFEST,
    SHARDED,
    TMP_PREFIX,
    fsync_dir,
    latest,
    sha256_of,
    step_dir_name,
)
from erlay.actors.learner.checkpoint.sharded_load import (
    DCP_KEYS,
    checkpoint_group,
    forget_groups,
    load_sharded,
    rank_file,
)
from erlay.actors.learner.checkpoint.snapshot import Copier, Snapshot, StagingBuffer, unstage
from erlay.actors.learner.checkpoint.worker import (
    ProgressDeadline,
    kill_worker,
    release_queues,
    stop_worker,
    why_lost,
)
from erlay.supervisor.failpoints import FailpointError, failpoint

__all__ = ["CheckpointSaveFailed", "ShardedCheckpointer", "load_sharded"]

log = logging.getLogger("erlay.checkpoint")

_POLL_INTERVAL_S = 0.05
_DEFAULT_TIMEOUT_S = 600.0
_STOP_GRACE_S = 5.0  # how long close() lets an idle worker exit, and a killed one die, at most


def _results_name(rank: int) -> str:
    return f".rank-{rank:05d}.results"


def _failed_name(rank: int) -> str:
    return f".rank-{rank:05d}.failed"


# --------------------------------------------------------------------------- the writer
class _ShardWriter(FileSystemWriterAsync):
    """NVRx's async DCP writer, planning this rank's whole shard into one file and leaving
    every tensor uncopied: the snapshot copies them, in the background, into the staging
    buffer (NVRx's own preparation would clone views on the training thread)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, thread_count=1, sync_files=True)

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        prefix = plan.storage_data.prefix
        flat = getattr(planner, "state_dict", {})  # the planner's flattened state
        bytes_data, tensor_data = [], []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                bytes_data.append((item, planner.resolve_data(item)))
                continue
            value = flat.get(item.index.fqn)
            if type(value) is DTensor and item.index.index in (None, 0):
                # What resolve_data returns (to_local(), a view), without its autograd
                # call per tensor: the same storage and version counter.
                data = value._local_tensor
            else:
                data = planner.resolve_data(item)
            tensor_data.append((item, data.detach()))
        name = f"{prefix}0{DEFAULT_SUFFIX}"
        self.write_buckets = [(os.path.join(self.checkpoint_dir, name), name,
                               (bytes_data, tensor_data))] if plan.items else []
        self.results_queue = None


# ------------------------------------------------------------------- the worker's side
def _file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def _write_fsynced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _persist_shard(tmp_dir: str, skeleton: Any, buffer: torch.Tensor, rank: int,
                   plain: bytes, transforms: Any, parent: int) -> None:
    """Runs in this rank's persistent worker: write the rank's shard (staged in ``buffer``)
    and its plain entries into ``tmp_dir``, then publish the results (module docstring,
    stage 2).  Never raises: a failure is published as ``.rank-XXXXX.failed``."""
    _exit_with_parent(parent)
    tmp = Path(tmp_dir)
    try:
        results: list[Any] = []
        files: dict[str, dict[str, Any]] = {}
        for index, bucket in enumerate(unstage(skeleton, buffer)):
            done: queue.Queue[Any] = queue.Queue()
            count: queue.Queue[int] = queue.Queue()
            count.put(index)
            FileSystemWriterAsync.write_preloaded_data([transforms], index, bucket, done,
                                                       count, use_fsync=True)
            _, written = done.get_nowait()
            if isinstance(written, Exception):
                raise written
            results += written
            files[bucket[1]] = _file_record(Path(bucket[0]))
            failpoint("learner.checkpoint_write")
        _write_fsynced(tmp / rank_file(rank), plain)
        files[rank_file(rank)] = _file_record(tmp / rank_file(rank))
        part = tmp / f"{_results_name(rank)}.part"
        _write_fsynced(part, pickle.dumps((results, files)))
        os.rename(part, tmp / _results_name(rank))
    except Exception:  # noqa: BLE001 - published through the failed file, see above
        try:
            (tmp / _failed_name(rank)).write_text(traceback.format_exc())
        except OSError:
            pass  # the agreement fails a rank whose worker reported nothing


# ------------------------------------------------------------------------ the checkpointer
def _layout_of(state: Any) -> int:
    """A checksum of ``state``'s structure: keys, and each tensor's type, dtype, and global
    and local shape (a different sharding changes the latter); values are left out.  Equal
    layouts plan equally."""
    parts: list[str] = []

    def walk(obj: Any, where: str) -> None:
        if isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, f"{where}.{key}")
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(value, f"{where}[{i}]")
        elif isinstance(obj, torch.Tensor):
            local = getattr(obj, "_local_tensor", obj)  # a DTensor's shard, else itself
            parts.append(f"{where}:{type(obj).__name__}:{obj.dtype}:{tuple(obj.shape)}:"
                         f"{tuple(local.shape)}")
        else:
            parts.append(f"{where}:{type(obj).__name__}")

    walk(state, "")
    return zlib.crc32("\n".join(parts).encode())


@dataclass
class _InFlight:
    """A save from save() to its commit, identical in kind on every rank."""

    step: int
    tmp: Path
    extra: dict[str, Any]
    writer: _ShardWriter
    metadata: Any  # DCP's global metadata, on rank 0 only
    snapshot: Snapshot
    started: float
    watch: ProgressDeadline
    handed_over: threading.Event = field(default_factory=threading.Event)
    handover_error: str | None = None
    # This rank's part, once known: (finished, failure).  Kept, because the library reports
    # a completion only once and the other ranks may still be writing then.
    local: tuple[bool, str | None] = (False, None)


class ShardedCheckpointer:
    """Saves sharded learner states under ``root`` in the background, keeping the newest
    ``keep``.  Collective: every rank of the default process group makes one on the same
    ``root`` (a directory all ranks share), and calls save(), poll(), wait() and close() at
    the same points.  Construction is not collective: rank 0 puts ``root`` back in order
    after a crash (:func:`~erlay.actors.learner.checkpoint.commit.recover_root`), so only one
    job may use a root at a time.  ``timeout_s`` bounds every checkpoint collective (a rank
    that died mid-save); ``deadline_s`` is each rank's write's progress deadline
    (``checkpoint.deadline_s``)."""

    def __init__(self, root: Path, keep: int = 3, *, timeout_s: float = _DEFAULT_TIMEOUT_S,
                 deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.root = Path(root)
        self.keep = keep
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            recover_root(self.root)
        newest = latest(self.root)
        self._committed = newest.step if newest is not None else None
        self._calls: AsyncCallsQueue | None = None
        self._staging = StagingBuffer()
        self._copier = Copier()
        self._snapshot: Snapshot | None = None
        self._inflight: _InFlight | None = None
        self._unreported: list[int] = []  # committed while save() waited
        self._group: Any = None
        self._plans = CheckpointMetadataCache()  # NVRx's cache of DCP's save plans
        self._layout: int | None = None          # this rank's state layout when planned
        self._owns_group = False
        self._closed = False

    # ------------------------------------------------------------------------ public API
    @property
    def committed(self) -> int | None:
        """The newest committed step under ``root`` (as of construction, then this
        checkpointer's commits), or None; the same on every rank."""
        return self._committed

    @property
    def in_flight(self) -> int | None:
        """The step being written, or None."""
        return self._inflight.step if self._inflight is not None else None

    @property
    def writer(self) -> tuple[int, int] | None:
        """``(step, pid)`` while this rank's worker process ``pid`` holds its part of the save
        of ``step`` (handed over, not yet agreed finished), else None."""
        inflight = self._inflight
        caller = self._calls.persistent_caller if self._calls is not None else None
        process = getattr(caller, "process", None)
        if inflight is None or process is None or not inflight.handed_over.is_set():
            return None
        return inflight.step, process.pid

    @property
    def last_snapshot(self) -> Snapshot | None:
        """The newest save's snapshot (its timings: ``copy_s``, ``cpu_s``, ``waited_s``)."""
        return self._snapshot

    def save(self, step: int, app_state: dict[str, Any],
             extra: dict[str, Any] | None = None) -> float:
        """Collective: start saving ``app_state`` (module docstring) as the checkpoint of
        ``step``; returns the seconds this rank was blocked here.

        A save still in flight is waited for first (its failure is raised here).  ValueError
        or TypeError at once for a non-JSON ``extra``, a state without ``"model"`` and
        ``"optimizer"``, or plain entries that do not pickle.  Do not modify the saved tensors
        before :meth:`wait_snapshot` returns.
        """
        started = time.perf_counter()
        if self._closed:
            raise RuntimeError("this checkpointer is closed")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        missing = [key for key in DCP_KEYS if key not in app_state]
        if missing:
            raise ValueError(f"app_state lacks {missing}: a sharded checkpoint needs the "
                             f"model's and the optimizer's state dicts")
        extra = json.loads(json.dumps(extra or {}))  # fails now, not at the commit
        plain = io.BytesIO()
        torch.save({k: v for k, v in app_state.items() if k not in DCP_KEYS}, plain)
        if self._inflight is not None:
            waited_for = self._inflight.step
            self._unreported += self._drain(timeout_s=None)  # collective, like save()
            log.info("save of step %d waited %.2f s for step %d to commit", step,
                     time.perf_counter() - started, waited_for)
        self.wait_snapshot()  # the staging buffer is reused
        self._owns_group = ensure_process_group() or self._owns_group
        if self._group is None:
            self._group = checkpoint_group(self.timeout_s)
        state = {key: app_state[key] for key in DCP_KEYS}
        layout = _layout_of(state)
        # One all-reduce: rank 0's nonce for the directory, and whether any rank's layout
        # changed since the cached plan was made (then every rank plans afresh).
        agreed = torch.tensor([secrets.randbits(31) if self.rank == 0 else 0,
                               int(layout != self._layout)], dtype=torch.int64)
        dist.all_reduce(agreed, group=self._group)
        if int(agreed[1]):
            self._plans = CheckpointMetadataCache()
        self._layout = layout
        tmp = self.root / f"{TMP_PREFIX}{step_dir_name(step)}-{int(agreed[0]):08x}"
        writer = _ShardWriter(tmp)
        _, metadata, _ = save_state_dict_async_plan(
            state, writer, process_group=self._group, planner=DefaultSavePlanner(),
            enable_cache=True, metadata_cache=self._plans)
        snapshot = Snapshot(self._staging, writer.write_buckets)
        self._snapshot = snapshot
        inflight = _InFlight(step, tmp, extra, writer, metadata, snapshot, time.monotonic(),
                             ProgressDeadline(self.deadline_s))
        self._inflight = inflight
        self._copier.submit(partial(self._snapshot_and_hand_over, inflight,
                                    plain.getvalue()))
        return time.perf_counter() - started

    def wait_snapshot(self, timeout_s: float | None = None) -> float:
        """The barrier: block until the newest save's tensors are copied; returns the seconds
        blocked.  TimeoutError after ``timeout_s``."""
        if self._snapshot is None:
            return 0.0
        return self._snapshot.wait(timeout_s)

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make every ``optimizer.step()`` first wait for the snapshot; returns the hook's
        handle."""
        def before_step(*_: Any) -> None:
            waited = self.wait_snapshot()
            if waited > 0.001:
                log.info("optimizer step waited %.3f s for the checkpoint snapshot", waited)
        return optimizer.register_step_pre_hook(before_step)

    def poll(self) -> list[int]:
        """Collective: commit the save in flight if every rank's worker has finished it;
        returns the steps committed (oldest first).  One small all-reduce while a save is in
        flight, nothing otherwise.  Raises :class:`CheckpointSaveFailed` on every rank for a
        failed save."""
        steps, self._unreported = self._unreported + self._advance(), []
        return steps

    def wait(self, timeout_s: float | None = None) -> list[int]:
        """Collective: block until no save is in flight; returns the steps committed.
        Raises :class:`CheckpointSaveFailed`, or TimeoutError after ``timeout_s`` (the save
        stays in flight; the deadline is rank 0's, so all ranks give up together)."""
        steps, self._unreported = self._unreported + self._drain(timeout_s), []
        return steps

    def close(self, timeout_s: float | None = None) -> None:
        """Collective: wait for the save in flight, then stop the worker (and the process
        group, if this checkpointer made it).  Raises what wait() raises."""
        if self._closed:
            return
        try:
            self.wait(timeout_s)
        finally:
            self._closed = True
            if self._snapshot is not None:
                self._snapshot.abort()
            self._copier.stop()
            self._stop_worker()
            self._staging = StagingBuffer()
            if self._owns_group and dist.is_initialized():
                forget_groups()
                dist.destroy_process_group()
            self._owns_group = False

    def abandon(self) -> None:
        """Not collective: give up the save in flight and close, without waiting for any
        peer (a rank shutting down on its own schedule).  The worker is killed, so a stopped
        one does not outlive this rank; the save's ``.tmp-`` directory is left for the next
        rank 0 to remove.  The process group is not destroyed here."""
        if self._closed:
            return
        self._closed = True
        self._inflight = None
        if self._snapshot is not None:
            self._snapshot.abort()
        self._copier.stop()
        if self._calls is not None:
            self._drop_worker(kill=True)
        self._staging = StagingBuffer()

    def __enter__(self) -> ShardedCheckpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------------- internals
    def _snapshot_and_hand_over(self, inflight: _InFlight, plain: bytes) -> None:
        """On the copy thread: copy the bucket's tensors, then (only if the copy is whole)
        queue the write for the worker, starting the worker on the first save."""
        try:
            snapshot = inflight.snapshot
            snapshot.run()
            if snapshot.error is None:
                request = AsyncRequest(
                    async_fn=_persist_shard,
                    async_fn_args=(str(inflight.tmp), snapshot.skeleton, self._staging.buffer,
                                   self.rank, plain, inflight.writer.transforms, os.getpid()),
                    finalize_fns=[])
                if self._calls is None:
                    self._calls = AsyncCallsQueue(persistent=True)
                self._calls.schedule_async_request(request)
        except Exception as exc:  # noqa: BLE001 - reported at the next agreement
            inflight.handover_error = f"handing the save to the worker failed: {exc}"
        finally:
            inflight.handed_over.set()

    def _local_state(self, inflight: _InFlight) -> tuple[bool, str | None]:
        """(finished, failure) of this rank's part of the save, without blocking."""
        if not inflight.local[0]:
            inflight.local = self._look(inflight)
        return inflight.local

    def _look(self, inflight: _InFlight) -> tuple[bool, str | None]:
        if not inflight.handed_over.is_set():
            return False, None
        reason = inflight.snapshot.error or inflight.handover_error
        if reason is not None:
            return True, reason
        assert self._calls is not None
        done = self._calls.maybe_finalize_async_calls(blocking=False, no_dist=True)
        lost = None if done else why_lost(self._calls.persistent_caller, inflight.watch,
                                          inflight.tmp, time.monotonic())
        if lost is not None:
            # Look once more: the worker may have reported completion meanwhile.
            done = self._calls.maybe_finalize_async_calls(blocking=False, no_dist=True)
            if not done:
                code = self._drop_worker(kill=lost != "died")
                return True, f"checkpoint worker {lost} (exit code {code})"
        if not done:
            return False, None
        failed = inflight.tmp / _failed_name(self.rank)
        if failed.exists():
            return True, failed.read_text().strip().splitlines()[-1]
        return True, None

    def _advance(self, deadline: float | None = None) -> list[int]:
        inflight = self._inflight
        if inflight is None:
            return []
        finished, reason = self._local_state(inflight)
        give_up = deadline is not None and self.rank == 0 and time.monotonic() >= deadline
        # [ranks not finished, ranks failed, rank 0 gives up]
        votes = torch.tensor([int(not finished), int(reason is not None), int(give_up)])
        dist.all_reduce(votes, group=self._group)
        running, failed, gave_up = (int(v) for v in votes)
        if running:
            if gave_up:
                raise TimeoutError(f"checkpoint of step {inflight.step} still in flight")
            return []
        outcome: list[Any] = [None]
        if failed:
            outcome = [f"{failed} rank(s) failed; rank {self.rank}: {reason}"
                       if reason else f"{failed} rank(s) failed"]
        else:
            outcome = self._finalize(inflight)
        self._inflight = None
        if outcome[0] is not None:
            if self.rank == 0:
                shutil.rmtree(inflight.tmp, ignore_errors=True)
            raise CheckpointSaveFailed(inflight.step, outcome[0])
        self._committed = max(inflight.step, self._committed or 0)
        log.info("sharded checkpoint of step %d committed after %.2f s", inflight.step,
                 time.monotonic() - inflight.started)
        return [inflight.step]

    def _finalize(self, inflight: _InFlight) -> list[Any]:
        """Every rank finished its files: gather their results to rank 0, which writes the
        index and the manifest and commits; returns ``[None]`` or ``[why it failed]``, the
        same on every rank."""
        try:
            mine: Any = pickle.loads((inflight.tmp / _results_name(self.rank)).read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError) as exc:
            mine = f"rank {self.rank}'s results are unreadable: {exc}"
        gathered: list[Any] | None = [None] * dist.get_world_size(self._group) \
            if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self._group)
        outcome: list[Any] = [None]
        if self.rank == 0:
            assert gathered is not None
            outcome = [self._commit(inflight, gathered)]
        dist.broadcast_object_list(outcome, src=0, group=self._group)
        return outcome

    def _commit(self, inflight: _InFlight, gathered: list[Any]) -> str | None:
        """Rank 0: write ``.metadata`` and the manifest, commit, retire (module docstring,
        stage 3); returns None or why it failed."""
        broken = [g for g in gathered if isinstance(g, str)]
        if broken:
            return broken[0]
        tmp = inflight.tmp
        try:
            inflight.writer.finish(inflight.metadata, [results for results, _ in gathered])
            files: dict[str, dict[str, Any]] = {}
            for _, written in gathered:
                files.update(written)
            files[DCP_METADATA] = _file_record(tmp / DCP_METADATA)
            for rank in range(len(gathered)):
                (tmp / _results_name(rank)).unlink(missing_ok=True)
            failpoint("learner.checkpoint_manifest")
            manifest = {"format": CHECKPOINT_FORMAT, "layout": SHARDED,
                        "world_size": len(gathered), "step": inflight.step,
                        "created_unix": time.time(), "files": files, "extra": inflight.extra}
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            commit_dir(tmp, self.root / step_dir_name(inflight.step))
        except Exception as exc:  # noqa: BLE001 - every rank must hear the outcome
            return f"finalizing failed: {type(exc).__name__}: {exc}"
        try:
            retire(self.root, self.keep)
        except (OSError, FailpointError) as exc:  # the save is committed all the same
            log.error("could not retire old checkpoints under %s: %s", self.root, exc)
        return None

    def _drain(self, timeout_s: float | None) -> list[int]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        committed: list[int] = []
        while self._inflight is not None:
            committed += self._advance(deadline)
            if self._inflight is not None:
                time.sleep(_POLL_INTERVAL_S)
        return committed

    def _worker_alive(self) -> bool:
        caller = self._calls.persistent_caller if self._calls is not None else None
        process = getattr(caller, "process", None)
        return process is not None and process.is_alive()

    def _drop_worker(self, *, kill: bool = False) -> int | None:
        """Forget the worker, killing it first with ``kill`` (the next save starts a new
        one); returns its exit code (None: it has not died yet)."""
        assert self._calls is not None
        caller = self._calls.persistent_caller
        self._calls = None
        if kill:
            return kill_worker(caller, min(self.deadline_s, _STOP_GRACE_S))
        process = caller.process
        caller.process = None
        release_queues(caller, flush=False)
        return process.exitcode if process is not None else None

    def _stop_worker(self) -> None:
        if self._calls is None:
            return
        caller = self._calls.persistent_caller
        if caller is not None:
            stop_worker(caller, min(self.deadline_s, _STOP_GRACE_S))
        self._calls = None

    def __del__(self) -> None:
        # Never closed with a dead worker: the library's finalizer would wait for ever.
        if getattr(self, "_calls", None) is not None and not self._worker_alive():
            self._calls.persistent_caller.process = None  # type: ignore[union-attr]

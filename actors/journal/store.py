"""The rollout journal: a durable, append-only log of every rollout transition.

:class:`Journal` is the coordinator's :class:`~erlay.actors.journal.transitions.TransitionSink`.
Every ``record`` appends one framed record to the current segment, hands it to the OS, and folds it
into the live :class:`~erlay.actors.journal.state.JournalState`; recovery folds the same records
in the same order, so ``journal.state`` after a reopen equals the state before the close.

Durability contract.  When ``record`` returns, the record has been written to the OS (the
Python buffer is flushed on every record), so a *process* crash, SIGKILL included, loses
nothing already recorded.  fsync only matters for a *machine* crash and follows
:class:`FsyncPolicy`: ``always`` fsyncs every record, in ``record``; ``batch`` fsyncs on a
thread of its own, never in ``record``: as soon as ``every_records`` records wait, or
``every_s`` after the last fsync when any does, so every record is on disk within ``every_s``
(plus the fsync's own time) of being recorded, and a slow disk never holds up the recording
thread (the coordinator), since the fsync runs outside the journal's lock, on a duplicate of
the segment's file descriptor (``unsynced`` counts the records still waiting); ``never``
fsyncs only in ``flush``, ``close``, segment rolls and snapshots, which fsync in every mode,
in the calling thread (a roll every ``segment_bytes``, a snapshot every ``snapshot_every``
records).  The fsync thread follows the journal's clock, ends with ``close`` (which fsyncs),
and holds the journal only weakly, so a journal dropped without ``close`` is still collected
and releases its lock.  An fsync that fails on that thread fails the journal: later records
raise :class:`JournalClosed`, as after a failed write.

On disk, under one directory::

    segment-000001.log     records: [u32 length][u32 crc32(payload)][payload], big-endian;
    segment-000002.log     payload = compact JSON {"seq", "kind", "rollout_id", "data"}
    snapshot-000002.snap   one framed record: {"format", "segment", "seq", "state"},
                           the folded state through the end of segment-000002
    LOCK                   flock'ed by the one writer

Segments roll at ``segment_bytes``.  Every ``snapshot_every`` records (and on
:meth:`Journal.snapshot`) the journal rolls to a new segment, compacts the state (consumed
rollouts keep only their id and step), writes a snapshot atomically (tmp file, fsync,
``os.replace``, fsync of the directory) and only then deletes what it no longer needs: it
keeps the newest ``keep_snapshots`` snapshots and the segments after the oldest of them, so
recovery reads one snapshot plus a bounded tail, whatever the run's length.

Recovery.  A torn or corrupt tail of the *last* segment (short header, short payload, CRC
mismatch, undecodable record) is what a crash mid-write leaves: it is truncated on disk to
the last whole record, logged and reported in :class:`RecoveryReport`.  Corruption anywhere
else (a segment followed by later segments, a missing segment, a sequence gap) is never
truncated: it raises :class:`JournalCorrupt` naming the file and offset.  A corrupt snapshot
falls back to the previous snapshot (or to the start of the log) when every segment after it
still exists, and raises :class:`JournalCorrupt` otherwise; a writer then sets the corrupt
file aside as ``*.corrupt`` and writes a fresh snapshot.  Leftover ``*.tmp`` files (a crash
mid-snapshot) are ignored, and removed by a writer.  ``read_only=True`` recovers the same
state but never modifies, truncates or removes anything (for inspection of a live run).

The format and recovery live in :mod:`erlay.actors.journal.format`, the fold in
:mod:`erlay.actors.journal.state`; this module is the writer.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, assert_never

from erlay.actors.journal.format import (
    HEADER,
    SEGMENT_FILE,
    SNAPSHOT_FILE,
    SNAPSHOT_FORMAT,
    JournalBusy,
    JournalClosed,
    JournalCorrupt,
    JournalNotFound,
    Recovered,
    RecoveryReport,
    dumps_compact,
    encode_record,
    frame,
    list_files,
    numbered_files,
    read_segment,
    recover,
    segment_name,
    snapshot_name,
)
from erlay.actors.journal.state import JournalState, apply, compact, state_to_dict
from erlay.actors.journal.transitions import Transition
from erlay.supervisor.clock import Clock, SystemClock

__all__ = [
    "HEADER", "FsyncPolicy", "Journal", "JournalBusy", "JournalClosed", "JournalCorrupt",
    "JournalNotFound", "JournalPosition", "RecoveryReport", "list_files", "read_segment",
    "segment_name", "snapshot_name",
]

log = logging.getLogger("erlay.journal")

# The longest an fsync timer sleeps before it looks again whether its journal still exists
# (and, under a fake clock, whether time has moved).
_TIMER_CHECK_S = 1.0


@dataclass(frozen=True)
class FsyncPolicy:
    """When records are fsynced; see the module docstring for the durability contract."""

    every_records: int = 256
    every_s: float = 0.05
    mode: Literal["batch", "always", "never"] = "batch"

    def __post_init__(self) -> None:
        if self.mode not in ("batch", "always", "never"):
            raise ValueError(f"FsyncPolicy.mode: expected batch|always|never, got {self.mode!r}")
        if self.every_records < 1 or self.every_s < 0:
            raise ValueError("FsyncPolicy: every_records must be >= 1 and every_s >= 0")


@dataclass(frozen=True)
class JournalPosition:
    """A snapshot the journal wrote: its file name, the last segment and record it covers.
    Self-contained: the snapshot alone rebuilds the state as of ``seq``."""

    snapshot: str
    segment: int
    seq: int


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` so a crash leaves either the old file, the new one, or a stray tmp."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class Journal:
    """A durable :class:`TransitionSink`; see the module docstring for format and contract.

    Thread-safe: every method takes one lock, so ``record`` may be called from an asyncio
    loop thread and others at once.  ``state`` is mutated under that lock; a thread other
    than the recording one should read it inside ``with journal.locked() as state:``.
    """

    def __init__(self, directory: Path, recovered: Recovered, fsync: FsyncPolicy,
                 segment_bytes: int, snapshot_every: int | None, keep_snapshots: int,
                 read_only: bool, clock: Clock) -> None:
        self.directory = directory
        self.fsync_policy = fsync
        self.segment_bytes = segment_bytes
        self.snapshot_every = snapshot_every
        self.keep_snapshots = keep_snapshots
        self.read_only = read_only
        self._clock = clock
        self._state = recovered.state
        self._recovery = recovered.report
        self._lock = threading.RLock()
        self._closed = read_only
        self._failed: BaseException | None = None
        self._file: IO[bytes] | None = None
        self._lock_file: IO[bytes] | None = None
        self._segment = recovered.last_segment or recovered.base
        self._size = recovered.last_size
        self._synced_seq = recovered.state.applied   # records up to this seq are on disk
        self._last_sync = clock.monotonic()
        self._wake = threading.Condition(self._lock)  # wakes the fsync timer
        self._timer: threading.Thread | None = None
        self._since_snapshot = recovered.report.records_replayed
        self._position: JournalPosition | None = None
        self._keep_from_step: int | None = None

    @classmethod
    def open(cls, directory: Path | str, *, fsync: FsyncPolicy | None = None,
             segment_bytes: int = 8 * 1024 * 1024, snapshot_every: int | None = 10_000,
             keep_snapshots: int = 2, read_only: bool = False,
             clock: Clock | None = None) -> Journal:
        """Create the journal in ``directory`` or recover the one there.

        ``snapshot_every`` records trigger an automatic snapshot (None: only explicit ones);
        ``keep_snapshots`` (>= 1) snapshots are kept, with the segments needed to recover from
        the oldest of them, so one corrupt snapshot can fall back to the one before.
        Raises JournalCorrupt (see the module docstring), JournalBusy if another writer holds
        the lock, and JournalNotFound for a read-only open of a missing directory.
        """
        if segment_bytes < 1 or keep_snapshots < 1 or (snapshot_every is not None
                                                       and snapshot_every < 1):
            raise ValueError("segment_bytes, keep_snapshots and snapshot_every must be >= 1")
        directory = Path(directory)
        if read_only and not directory.is_dir():
            raise JournalNotFound(f"no journal directory at {directory}")
        lock_file = None
        if not read_only:
            directory.mkdir(parents=True, exist_ok=True)
            lock_file = open(directory / "LOCK", "ab")  # noqa: SIM115 (held until close)
            try:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock_file.close()
                raise JournalBusy(f"another writer holds the journal at {directory}") from None
        try:
            recovered = recover(directory, read_only)
        except BaseException:
            if lock_file is not None:
                lock_file.close()
            raise
        journal = cls(directory, recovered, fsync or FsyncPolicy(), segment_bytes,
                      snapshot_every, keep_snapshots, read_only, clock or SystemClock())
        if not read_only:
            journal._lock_file = lock_file
            try:
                journal._start_writing(recovered)
            except BaseException:
                journal.close()
                raise
        if not recovered.report.clean:
            log.warning("journal %s: %s", directory, recovered.report.describe())
        return journal

    def _start_writing(self, recovered: Recovered) -> None:
        for name in recovered.report.removed_tmp:
            (self.directory / name).unlink(missing_ok=True)
        for path in recovered.corrupt_snapshots:
            # Set aside, so retention never counts it as a snapshot to recover from.
            path.rename(path.with_name(path.name + ".corrupt"))
        if recovered.last_segment:
            self._file = open(self.directory / segment_name(self._segment), "ab")  # noqa: SIM115
        else:
            self._segment += 1
            self._open_segment()
        if recovered.corrupt_snapshots:
            self._snapshot_locked()
        else:
            self._apply_retention()
        if self.fsync_policy.mode == "batch":
            self._timer = threading.Thread(
                target=_run_fsync_timer, args=(weakref.ref(self), self._wake),
                name=f"erlay-journal-fsync-{self.directory.name}", daemon=True)
            self._timer.start()

    # ------------------------------------------------------------------ accessors
    @property
    def state(self) -> JournalState:
        """The live folded state (see the class docstring on threads)."""
        return self._state

    @property
    def recovery(self) -> RecoveryReport:
        return self._recovery

    @property
    def unsynced(self) -> int:
        """Records handed to the OS but not yet fsynced."""
        return self._state.applied - self._synced_seq

    @property
    def position(self) -> JournalPosition | None:
        """The last snapshot this journal object wrote, if any."""
        return self._position

    @contextlib.contextmanager
    def locked(self) -> Iterator[JournalState]:
        """Hold the journal's lock while reading the state from another thread."""
        with self._lock:
            yield self._state

    # -------------------------------------------------------------------- writing
    def record(self, transition: Transition) -> None:
        """Append ``transition``, hand it to the OS, fold it into ``state``.

        Raises JournalClosed after close, in read-only mode or after a failed write (the
        segment's tail is then unknown, so nothing more may go after it), and TypeError for
        data that is not JSON-serializable (nothing is written then)."""
        with self._lock:
            self._check_writable()
            payload = encode_record(self._state.applied + 1, transition)
            # Fold what recovery will read back (tuples become lists, data is copied), so the
            # live state equals the recovered one exactly.
            obj = json.loads(payload)
            del obj["seq"]
            decoded = Transition.from_dict(obj)
            data = frame(payload)
            if self._size > 0 and self._size + len(data) > self.segment_bytes:
                self._roll_locked()
            assert self._file is not None
            try:
                self._file.write(data)
                self._file.flush()
            except BaseException as exc:
                self._failed = exc
                raise
            self._size += len(data)
            apply(self._state, decoded)
            self._since_snapshot += 1
            self._maybe_sync()
            if self.snapshot_every is not None and self._since_snapshot >= self.snapshot_every:
                try:
                    self._snapshot_locked()
                except OSError as exc:
                    # The record itself is safe; raising here would invite a duplicate retry.
                    log.warning("journal %s: automatic snapshot failed: %s", self.directory,
                                exc)
                    self._since_snapshot = 0

    def flush(self) -> None:
        """fsync everything recorded so far (every mode)."""
        with self._lock:
            self._check_writable()
            self._sync_locked()

    def retain_from_step(self, step: int) -> None:
        """Compaction keeps the records of rollouts consumed at ``step`` or later (the
        trajectories to feed again after a learner restores its last committed checkpoint,
        taken at ``step``).  Only ever moves forward."""
        with self._lock:
            if self._keep_from_step is None or step > self._keep_from_step:
                self._keep_from_step = step

    def snapshot(self) -> JournalPosition:
        """Roll, compact and write a snapshot now; return its position.  With no record since
        the last snapshot this journal wrote, return that one."""
        with self._lock:
            self._check_writable()
            return self._snapshot_locked()

    def close(self) -> None:
        """fsync and close, and stop the fsync timer; idempotent.  A failed journal closes
        without fsync."""
        with self._lock:
            if self._file is not None:
                try:
                    if self._failed is None:
                        self._sync_locked()
                finally:
                    self._file.close()
                    self._file = None
            if self._lock_file is not None:
                self._lock_file.close()  # releases the flock
                self._lock_file = None
            self._closed = True
            self._wake.notify_all()
        timer, self._timer = self._timer, None
        if timer is not None and timer is not threading.current_thread():
            timer.join()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _check_writable(self) -> None:
        if self._failed is not None:
            raise JournalClosed(f"journal {self.directory} failed on a write: {self._failed!r}")
        if self.read_only:
            raise JournalClosed(f"journal {self.directory} is open read-only")
        if self._closed:
            raise JournalClosed(f"journal {self.directory} is closed")

    def _maybe_sync(self) -> None:
        policy = self.fsync_policy
        match policy.mode:
            case "always":
                self._sync_locked()
            case "batch":
                if self.unsynced >= policy.every_records:
                    self._wake.notify()  # the fsync thread syncs them now
                elif self.unsynced == 1:
                    self._wake.notify()  # and counts every_s for the first one waiting
            case "never":
                pass
            case _:
                assert_never(policy.mode)

    def _timer_tick(self) -> float | _Sync | None:
        """One look of the fsync thread (under the lock): a :class:`_Sync` to run outside
        the lock when records wait and ``every_records`` of them do or ``every_s`` has passed
        since the last fsync; else the seconds to sleep before the next look; None to stop."""
        if self._closed or self._failed is not None:
            return None
        waiting = self.unsynced
        if waiting == 0:
            return _TIMER_CHECK_S
        left = self._last_sync + self.fsync_policy.every_s - self._clock.monotonic()
        if left > 0 and waiting < self.fsync_policy.every_records:
            return min(left, _TIMER_CHECK_S)
        assert self._file is not None
        self._file.flush()
        # A duplicate: a roll may close the segment's file while the fsync runs.
        return _Sync(os.dup(self._file.fileno()), self._state.applied)

    def _finish_sync(self, sync: _Sync) -> bool:
        """Run ``sync`` (outside the lock), then record it; False when it failed, which
        fails the journal."""
        try:
            os.fsync(sync.fd)
        except OSError as exc:
            with self._lock:
                # The records' durability is unknown now (an fsync error may have dropped
                # dirty pages): refuse more records rather than let them look safe.
                self._failed = exc
            log.error("journal %s: fsync failed on the fsync thread: %s", self.directory, exc)
            return False
        finally:
            os.close(sync.fd)
        with self._lock:
            self._synced_seq = max(self._synced_seq, sync.through)
            self._last_sync = self._clock.monotonic()
        return True

    def _sync_locked(self) -> None:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._synced_seq = self._state.applied
        self._last_sync = self._clock.monotonic()

    def _open_segment(self) -> None:
        self._file = open(self.directory / segment_name(self._segment), "ab")  # noqa: SIM115
        self._size = 0
        _fsync_dir(self.directory)  # the new name must survive a machine crash too

    def _roll_locked(self) -> None:
        # fsync the old segment first: a later segment must never outlive an earlier
        # segment's tail, or recovery would find a hole in the middle of the log.
        self._sync_locked()
        assert self._file is not None
        self._file.close()
        self._segment += 1
        try:
            self._open_segment()
        except BaseException as exc:
            self._failed = exc  # no segment to write to: refuse records rather than lose them
            raise

    def _snapshot_locked(self) -> JournalPosition:
        if self._since_snapshot == 0 and self._position is not None:
            return self._position
        covered = self._segment
        self._roll_locked()
        compact(self._state, self._keep_from_step)
        body = dumps_compact({"format": SNAPSHOT_FORMAT, "segment": covered,
                              "seq": self._state.applied,
                              "state": state_to_dict(self._state)}).encode()
        _write_atomic(self.directory / snapshot_name(covered), frame(body))
        self._since_snapshot = 0
        self._position = JournalPosition(snapshot_name(covered), covered, self._state.applied)
        self._apply_retention()
        return self._position

    def _apply_retention(self) -> None:
        """Delete snapshots older than the ``keep_snapshots`` newest, and every segment the
        oldest kept one covers.  Runs only after a snapshot is durable."""
        snapshots = numbered_files(self.directory, SNAPSHOT_FILE)
        if len(snapshots) < self.keep_snapshots:
            return
        floor = sorted(snapshots)[-self.keep_snapshots]
        for n, path in sorted(numbered_files(self.directory, SEGMENT_FILE).items()):
            if n <= floor:
                path.unlink(missing_ok=True)
        for n, path in snapshots.items():
            if n < floor:
                path.unlink(missing_ok=True)


@dataclass(frozen=True)
class _Sync:
    """One fsync for the fsync thread: a duplicate of the segment's descriptor, and the last
    record it covers."""

    fd: int
    through: int


def _run_fsync_timer(journal_ref: weakref.ref[Journal], wake: threading.Condition) -> None:
    """The body of a batch journal's fsync thread (see the module docstring).

    It holds the journal's lock only while it looks (``Journal._timer_tick``), never while it
    fsyncs or sleeps, holds the journal itself only weakly, and ends when the journal
    closes, fails or is collected."""
    while True:
        with wake:
            journal = journal_ref()
            plan = journal._timer_tick() if journal is not None else None
            del journal
            if plan is None:
                return
            if not isinstance(plan, _Sync):
                wake.wait(plan)
                continue
        journal = journal_ref()
        if journal is None:
            os.close(plan.fd)
            return
        ok = journal._finish_sync(plan)
        del journal
        if not ok:
            return

"""Mirroring a run directory's durable files to its remote home, in the background.

A run on remote storage (``run.storage=s3://...``) works in a local directory on fast disk:
the journal fsyncs there, checkpoints are staged and committed there, logs are appended
there.  A :class:`Mirror` uploads what changed every ``interval_s`` seconds, on a thread of
its own, so no step ever waits for the store.  Two mirrors share a run, each with the files
its process writes: the driver's (config, metrics, events, journal, summary, report,
telemetry) and the learner rank 0's (``checkpoints/``, ``ledger.jsonl``), which may run on
another node (:func:`driver_files`, :func:`learner_files`).

Contracts:

- **A file is uploaded whole**, as it was when read; a file that changed since is uploaded
  again at the next tick.  Append-only files (metrics, events, ledger, journal segments) are
  uploaded again whole: object stores have no append.
- **Order within a tick** (:func:`plan`): the ledger first, then the journal's files by
  number (segment ``n`` before snapshot ``n`` before segment ``n+1``), then checkpoint data
  files, then each checkpoint's ``manifest.json``, then the rest; removals of files gone
  locally (journal compaction, checkpoint retention; nothing else is ever removed remotely,
  and nothing at all once the local directory is gone) come after every upload.  So at every
  instant the remote journal is one the journal's own recovery reads (a snapshot and the
  contiguous segments after it; a torn last segment is truncated on read), and a remote
  checkpoint with a manifest has every file the manifest lists.
- **Checkpoints are atomic.**  A checkpoint's manifest is uploaded last; before a checkpoint
  whose manifest is already remote is uploaded again (a re-save of the step), and before a
  retired one is removed, its remote manifest is removed first.  A reader takes a remote
  ``step-*`` for complete only with its manifest
  (:func:`~erlay.actors.storage.fetch.usable_checkpoints`).
- **Failures are retried, never raised into the job.**  A tick that fails is logged and
  recorded (:attr:`Mirror.last_error`); the next tick tries again.  :meth:`Mirror.flush`
  is where a caller learns whether everything made it: it waits, with a deadline, for a tick
  that started after it and uploaded everything.
- **Checkpoints go at once.**  Besides the ticks, a pass starts within
  :data:`MARK_POLL_S` of a new committed checkpoint (the learner's mirror) or a new journal
  snapshot, which the coordinator takes with each checkpoint (the driver's): so the bucket
  soon holds a checkpoint and a journal that reaches it.
- **What a crash loses.**  A crash of this process's machine loses what changed after the
  last finished pass: at most ``interval_s`` plus one pass's upload time of journal records
  and log lines, and a checkpoint committed less than one pass ago (a resume restores the
  newest remote one and trains the steps after it again).  :attr:`Mirror.lag_s` records, per
  uploaded file, how long its newest bytes waited (upload end minus modification time).

May import: erlay.supervisor, erlay.actors.storage.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from erlay.actors.storage.remote import Remote, StorageError, one_line

log = logging.getLogger(__name__)

LEDGER = "ledger.jsonl"
CHECKPOINTS = "checkpoints/"
MANIFEST = "manifest.json"
_JOURNAL_FILE = re.compile(r"^journal/(segment|snapshot)-(\d+)\.(log|snap)$")
_CHECKPOINT_FILE = re.compile(r"^checkpoints/(step-\d+)/(.+)$")
MARK_POLL_S = 0.5
# Written and renamed into place, or held open by one writer: never uploaded.
_TRANSIENT = re.compile(r"(^|/)(\.[^/]*|[^/]*\.(tmp|part)|LOCK)(/|$)")


def _names(directory: Path, pattern: re.Pattern[str]) -> frozenset[str]:
    try:
        return frozenset(n for n in os.listdir(directory) if pattern.match(n))
    except FileNotFoundError:
        return frozenset()


_STEP_DIR = re.compile(r"^step-\d+$")
_SNAPSHOT = re.compile(r"^snapshot-\d+\.snap$")


def checkpoint_marks(root: Path) -> frozenset[str]:
    """The committed checkpoints under ``root``: a new one is uploaded at once."""
    return _names(root / "checkpoints", _STEP_DIR)


def snapshot_marks(root: Path) -> frozenset[str]:
    """The journal's snapshots under ``root`` (one per checkpoint): a new one is uploaded at
    once, so the remote journal reaches the checkpoint that names it."""
    return _names(root / "journal", _SNAPSHOT)


def driver_files(rel: str) -> bool:
    """The driver's share of a run directory: everything but the learner's."""
    return not learner_files(rel)


def learner_files(rel: str) -> bool:
    """Learner rank 0's share: its checkpoints and its ledger."""
    return rel == LEDGER or rel.startswith(CHECKPOINTS)


@dataclass(frozen=True)
class FileState:
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Plan:
    """One tick's work, in order: remote manifests to remove first, files to upload, then
    remote files to remove."""

    unpublish: tuple[str, ...]
    puts: tuple[str, ...]
    removes: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.unpublish or self.puts or self.removes)


def scan(root: Path, select: Callable[[str], bool]) -> dict[str, FileState]:
    """The files under ``root`` that ``select`` takes, by relative path; transient names
    (dot-files and dot-directories, ``*.tmp``, ``*.part``, the journal's ``LOCK``) skipped."""
    found: dict[str, FileState] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        base = Path(dirpath).relative_to(root).as_posix()
        for name in filenames:
            rel = name if base == "." else f"{base}/{name}"
            if _TRANSIENT.search(rel) or not select(rel):
                continue
            try:
                st = os.stat(os.path.join(dirpath, name))
            except FileNotFoundError:   # removed since the walk listed it
                continue
            found[rel] = FileState(st.st_size, st.st_mtime_ns)
    return found


def _order(rel: str) -> tuple[int, int, int, str]:
    if rel == LEDGER:
        return (0, 0, 0, rel)
    journal = _JOURNAL_FILE.match(rel)
    if journal:
        return (1, int(journal.group(2)), journal.group(1) == "snapshot", rel)
    ckpt = _CHECKPOINT_FILE.match(rel)
    if ckpt:
        return (3 if ckpt.group(2) == MANIFEST else 2, 0, 0, rel)
    return (4, 0, 0, rel)


def _checkpoint_of(rel: str) -> str | None:
    match = _CHECKPOINT_FILE.match(rel)
    return match.group(1) if match else None


def plan(local: Mapping[str, FileState], uploaded: Mapping[str, FileState],
         present: frozenset[str] = frozenset({"journal", "checkpoints"})) -> Plan:
    """What to do to make the remote hold ``local``, given what was ``uploaded`` (the
    contract's order).  Only what the journal's compaction and the checkpoints' retention
    remove is ever removed remotely, and only while its local directory (``present``: the
    top-level directories that exist) does: a working copy deleted or lost under a live
    process must not wipe the run's remote home.  Pure."""
    puts = sorted((r for r, s in local.items() if uploaded.get(r) != s), key=_order)
    gone = [r for r in uploaded if r not in local and r.partition("/")[0] in present
            and r.startswith(("journal/", "checkpoints/"))]
    # A checkpoint whose files change, or which goes, loses its remote manifest first.
    touched = {c for c in map(_checkpoint_of, [*puts, *gone]) if c}
    unpublish = sorted(f"checkpoints/{c}/{MANIFEST}" for c in touched
                       if f"checkpoints/{c}/{MANIFEST}" in uploaded)
    removes = sorted((r for r in gone if r not in unpublish),
                     key=lambda r: (_order(r)[0] != 3, r))
    return Plan(tuple(unpublish), tuple(puts), tuple(removes))


@dataclass(frozen=True)
class FlushResult:
    ok: bool
    error: str | None = None

    def describe(self) -> str:
        return "uploaded" if self.ok else f"not uploaded: {self.error}"


class Mirror:
    """Uploads ``select``'s files under ``local`` to ``remote`` every ``interval_s`` on a
    daemon thread (module docstring).  ``start`` seeds what the remote already holds (a
    resumed run does not upload what it downloaded), on the thread."""

    def __init__(self, local: Path, remote: Remote, select: Callable[[str], bool],
                 interval_s: float = 5.0, name: str = "mirror",
                 marks: Callable[[Path], frozenset[str]] | None = None) -> None:
        self.local, self.remote, self.select = Path(local), remote, select
        self.interval_s = interval_s
        # What starts a pass at once, between the ticks: a new checkpoint, a new journal
        # snapshot (checkpoint_marks, snapshot_marks), looked at every MARK_POLL_S.
        self.marks = marks
        self._marked: frozenset[str] = frozenset()
        self.name = name
        self.uploaded: dict[str, FileState] = {}
        self.last_error: str | None = None
        self.ticks = 0
        self.files_uploaded = 0
        self.bytes_uploaded = 0
        self.lag_s: collections.deque[float] = collections.deque(maxlen=4096)
        self._seeded = False
        self._cond = threading.Condition()
        self._wanted = 0      # tick requests (flush), by sequence number
        self._done = 0        # the newest request a finished tick served
        self._clean = True    # whether that tick finished with nothing left to do
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> Mirror:
        self._thread = threading.Thread(target=self._loop, name=f"erlay-{self.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def _seed(self) -> None:
        """Take files the remote already holds with the local size as uploaded."""
        remote = self.remote.listing()
        for rel, state in scan(self.local, self.select).items():
            if remote.get(rel) == state.size:
                self.uploaded[rel] = state
        self._seeded = True

    def tick(self) -> bool:
        """One pass: upload what changed, in :func:`plan`'s order; True when nothing was left
        to do after it.  StorageError when the store refuses (the files done so far count)."""
        if not self._seeded:
            self._seed()
        self.ticks += 1
        if not self.local.is_dir():   # the working copy is gone: nothing to mirror
            return True
        work = plan(scan(self.local, self.select), self.uploaded, self._present())
        for rel in work.unpublish:
            self.remote.delete(rel)
            self.uploaded.pop(rel, None)
        for rel in work.puts:
            path = self.local / rel
            try:
                st = os.stat(path)
                size = self.remote.put(path, rel)
            except FileNotFoundError:   # removed since the scan: the next plan removes it
                continue
            self.uploaded[rel] = FileState(size, st.st_mtime_ns) if size == st.st_size \
                else FileState(size, -1)   # grew while read: upload again next tick
            self.files_uploaded += 1
            self.bytes_uploaded += size
            self.lag_s.append(max(0.0, time.time() - st.st_mtime_ns / 1e9))
        for rel in work.removes:
            self.remote.delete(rel)
            self.uploaded.pop(rel, None)
        return not plan(scan(self.local, self.select), self.uploaded, self._present())

    def _present(self) -> frozenset[str]:
        return frozenset(d for d in ("journal", "checkpoints") if (self.local / d).is_dir())

    def _marked_now(self) -> bool:
        """Whether a mark appeared since the last pass (and remember it)."""
        if self.marks is None:
            return False
        now = self.marks(self.local)
        fresh = bool(now - self._marked)
        self._marked = now
        return fresh

    def _loop(self) -> None:
        first = True   # the first pass at once: the config is remote before the first step
        while True:
            with self._cond:
                due = time.monotonic() + (0.0 if first else self.interval_s)
                while not self._stop and self._wanted == self._done:
                    left = due - time.monotonic()
                    if left <= 0 or self._marked_now():
                        break
                    self._cond.wait(min(left, MARK_POLL_S) if self.marks else left)
                first = False
                if self._stop and self._wanted == self._done:
                    return
                serving = self._wanted
            try:
                clean = self.tick()
                self.last_error = None
            except (StorageError, OSError) as exc:
                clean = False
                self.last_error = one_line(exc)
                log.warning("storage: %s could not upload to %s: %s", self.name,
                            self.remote.url, self.last_error)
            except Exception as exc:   # a bug here must not end the mirror
                clean = False
                self.last_error = f"{type(exc).__name__}: {one_line(exc)}"
                log.exception("storage: %s failed a tick", self.name)
            with self._cond:
                self._done, self._clean = serving, clean
                self._cond.notify_all()

    def flush(self, timeout_s: float) -> FlushResult:
        """Wait at most ``timeout_s`` for a tick that starts after this call and leaves
        nothing to upload (ticks that leave work, or fail, are retried until the deadline)."""
        deadline = time.monotonic() + timeout_s
        if self._thread is None or not self._thread.is_alive():
            return FlushResult(False, "the mirror is not running")
        while True:
            with self._cond:
                self._wanted += 1
                ticket = self._wanted
                self._cond.notify_all()
                while self._done < ticket:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return FlushResult(False, f"still uploading to {self.remote.url} after "
                                           f"{timeout_s:.0f} s ({self.last_error or 'slow'})")
                    self._cond.wait(left)
                if self._clean:
                    return FlushResult(True)
            if time.monotonic() >= deadline:
                return FlushResult(False, self.last_error or "files kept changing")
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def close(self, timeout_s: float) -> FlushResult:
        """:meth:`flush`, then stop the thread."""
        result = self.flush(timeout_s)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, min(timeout_s, 5.0)))
        return result

    def stats(self) -> dict[str, object]:
        lags = sorted(self.lag_s)
        return {"ticks": self.ticks, "files": self.files_uploaded,
                "bytes": self.bytes_uploaded, "last_error": self.last_error,
                "lag_s_p50": round(lags[len(lags) // 2], 3) if lags else None,
                "lag_s_max": round(lags[-1], 3) if lags else None}

"""The commands' side of remote run storage: a run on an object store resumed, exported or
reported on a machine that may never have seen it.

- :func:`prepare_remote` (``erlay run`` with ``run.storage=s3://...``): the store answers and
  takes writes, said in one line before anything starts;
- :func:`resume_remote` (``erlay run --resume s3://.../RUN``): the run fetched into a fresh
  local copy under the staging root, with the newest checkpoint its journal reaches
  (:func:`erlay.actors.storage.fetch.fetch_run`), newer remote checkpoints retired, and the
  remote kept as its home;
- :func:`fetched` (``erlay export``, ``erlay report``): a temporary local copy, removed after;
- :func:`upload_tree`: a directory written locally (an export, a report) put under a URL.

Every failure a user can cause raises :class:`~erlay.actors.storage.remote.StorageError` with
one line; the commands turn it into exit code 2.

May import: erlay.supervisor, erlay.actors.storage, erlay.actors.rundir.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from erlay.actors.rundir import DEFAULT_STAGING, RunDir, expand_path
from erlay.actors.storage.fetch import Fetched, fetch_run, retire_checkpoints
from erlay.actors.storage.remote import Remote, StorageError, basename, open_remote


def prepare_remote(url: str) -> Remote:
    """``url`` opened and probed (a write, a read, a removal): StorageError in one line for a
    missing bucket, refused credentials or an endpoint that does not answer."""
    remote = open_remote(url)
    remote.probe()
    return remote


def resume_remote(url: str, staging: str | None = None) -> tuple[RunDir, Fetched]:
    """The remote run at ``url`` fetched into a new local copy
    ``<staging>/<run id>[-resumed-N]`` (never into a copy that exists: a copy left by the
    crashed run may disagree with the remote), opened with ``url`` as its remote home."""
    remote = prepare_remote(url)
    root = expand_path(staging or DEFAULT_STAGING, os.environ, Path.cwd())
    root.mkdir(parents=True, exist_ok=True)
    name, n = basename(url), 1
    local = root / name
    while True:
        try:
            local.mkdir()
            break
        except FileExistsError:
            n += 1
            local = root / f"{name}-resumed-{n}"
    try:
        fetched = fetch_run(remote, local, checkpoint="resume")
    except BaseException:
        shutil.rmtree(local, ignore_errors=True)
        raise
    # Newer checkpoints the remote journal does not reach are not this run's any more: a
    # learner that fetched one (fetch_newer_checkpoint) would train past what the journal
    # knows.  The resumed run saves those steps again.
    retire_checkpoints(remote, fetched.skipped_checkpoints)
    return RunDir.open(local, remote), fetched


@contextlib.contextmanager
def fetched(url: str, *, checkpoint: str, step: int | None = None,
            journal: bool = True) -> Iterator[Path]:
    """A temporary local copy of the remote run at ``url`` (:func:`fetch_run`'s
    ``checkpoint`` and ``step``), removed on exit."""
    remote = open_remote(url)
    with tempfile.TemporaryDirectory(prefix="erlay-fetch-") as tmp:
        local = Path(tmp) / basename(url)
        local.mkdir()
        fetch_run(remote, local, checkpoint=checkpoint, step=step, journal=journal)
        yield local


def upload_tree(local: Path, url: str) -> int:
    """Upload every file under ``local`` to ``url`` (relative paths kept); the files'
    count.  StorageError names the file that would not go."""
    remote = open_remote(url)
    count = 0
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        remote.put(path, path.relative_to(local).as_posix())
        count += 1
    if count == 0:
        raise StorageError(f"nothing to upload from {local}")
    return count

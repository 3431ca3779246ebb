"""The learner's side of remote run storage (``run.storage=s3://...``).

Rank 0 writes the checkpoints and the ledger on its own node's disk; :func:`start_mirror`
uploads them to the run's remote home in the background
(:class:`~erlay.actors.storage.mirror.Mirror`: the ledger first, each checkpoint's manifest
after its files), and :func:`settle` is the bounded wait at the end of a run.  A rank that
starts on a node whose disk lacks the run's newest checkpoint (a restart on another node, a
resume elsewhere) first fetches it (:func:`fetch_newer_checkpoint`), so every rank restores
the same step.

May import: erlay.supervisor, erlay.actors.storage, erlay.actors.learner.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import Any

from erlay.actors.learner.checkpoint.format import TMP_PREFIX, latest, step_dir_name
from erlay.actors.learner.options import LearnerOptions
from erlay.actors.storage.fetch import manifests, usable_checkpoints
from erlay.actors.storage.mirror import Mirror, checkpoint_marks, learner_files
from erlay.actors.storage.remote import StorageError, open_remote

log = logging.getLogger(__name__)


def start_mirror(o: LearnerOptions) -> Mirror | None:
    """Rank 0's mirror of ``checkpoints/`` and ``ledger.jsonl``, started; None without
    remote storage, on other ranks, or without a checkpoint directory."""
    if not o.remote_url or o.rank != 0 or not o.checkpoint_dir:
        return None
    local = Path(o.checkpoint_dir).parent
    return Mirror(local, open_remote(o.remote_url), learner_files, o.upload_every_s,
                  name="learner mirror", marks=checkpoint_marks).start()


def settle(mirror: Mirror | None, timeout_s: float) -> dict[str, Any] | None:
    """Wait at most ``timeout_s`` for everything written so far to be uploaded: None
    without a mirror, else ``{"ok", "error", **stats}``."""
    if mirror is None:
        return None
    done = mirror.flush(timeout_s)
    return {"ok": done.ok, "error": done.error, **mirror.stats()}


def fetch_newer_checkpoint(o: LearnerOptions) -> int | None:
    """The newest complete remote checkpoint, fetched into ``checkpoint_dir`` when it is
    newer than every local one; its step, or None when nothing was fetched.  A checkpoint
    fetched under a temporary name and renamed into place, so a crash mid-fetch leaves
    nothing a reader takes for a checkpoint."""
    if not o.remote_url or not o.checkpoint_dir:
        return None
    root = Path(o.checkpoint_dir)
    local = latest(root) if root.exists() else None
    try:
        remote = open_remote(o.remote_url)
        listing = remote.listing("checkpoints")   # paths relative to the run
        steps = usable_checkpoints(listing, manifests(remote, listing), with_journal=False)
    except StorageError as exc:
        log.warning("learner: cannot list the remote checkpoints (%s); restoring what this "
                    "node holds", exc)
        return None
    if not steps or (local is not None and local.step >= steps[0]):
        return None
    step = steps[0]
    name = step_dir_name(step)
    tmp = root / f"{TMP_PREFIX}fetch-{secrets.token_hex(4)}"
    for rel in sorted(r for r in listing if r.startswith(f"checkpoints/{name}/")):
        remote.get(rel, tmp / rel.removeprefix(f"checkpoints/{name}/"))
    try:
        os.rename(tmp, root / name)
    except OSError:   # another rank of this node fetched it first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    log.warning("learner rank %d fetched the checkpoint of step %d from %s", o.rank, step,
                o.remote_url)
    return step

"""Reading a run back from its remote home: for ``--resume``, ``export`` and ``report`` on a
machine that never saw the run.

A remote run is the mirror's copy (:mod:`~erlay.actors.storage.mirror`): the driver's files
as of its last tick, and the learner's checkpoints and ledger as of the learner's.  The two
mirrors tick independently, so the newest remote checkpoint may be ahead of the remote
journal.  A resume needs both to agree: :func:`usable_checkpoints` takes a checkpoint only
when its manifest and every file it lists are there and the remote journal reaches the
journal snapshot the checkpoint names (the snapshot itself or a later one, or a segment after
it).  The resume restores the newest such checkpoint and trains the steps after it again,
as after any crash.

May import: erlay.supervisor, erlay.actors.storage.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from erlay.actors.storage.mirror import MANIFEST
from erlay.actors.storage.remote import Remote, StorageError

log = logging.getLogger(__name__)

_STEP = re.compile(r"^checkpoints/step-(\d+)/manifest\.json$")
_JOURNAL = re.compile(r"^journal/(segment|snapshot)-(\d+)\.(log|snap)$")


def journal_reaches(listing: Mapping[str, int], snapshot: str | None) -> bool:
    """Whether the remote journal in ``listing`` holds everything up to ``snapshot`` (a name
    such as ``snapshot-000004.snap``; None: a checkpoint taken without a journal, which
    needs none).  Pure."""
    if snapshot is None:
        return True
    match = re.match(r"^snapshot-(\d+)\.snap$", snapshot)
    if match is None:
        return False
    n = int(match.group(1))
    for rel in listing:
        found = _JOURNAL.match(rel)
        if found and ((found.group(1) == "snapshot" and int(found.group(2)) >= n)
                      or (found.group(1) == "segment" and int(found.group(2)) > n)):
            return True
    return False


def complete(listing: Mapping[str, int], step_dir: str, manifest: Mapping[str, Any]) -> bool:
    """Whether every file ``manifest`` lists is in ``listing`` under ``step_dir`` with its
    recorded size.  Pure."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return False
    return all(listing.get(f"{step_dir}/{name}") == record.get("bytes")
               for name, record in files.items() if isinstance(record, dict))


def usable_checkpoints(listing: Mapping[str, int], manifests: Mapping[int, Mapping[str, Any]],
                       *, with_journal: bool) -> list[int]:
    """The steps of the remote checkpoints a run can restore, newest first: complete
    (:func:`complete`), and, ``with_journal``, reached by the remote journal.  Pure."""
    steps = []
    for step, manifest in manifests.items():
        step_dir = f"checkpoints/step-{step:08d}"
        if not complete(listing, step_dir, manifest):
            continue
        snapshot = (manifest.get("extra") or {}).get("journal_snapshot")
        if with_journal and not journal_reaches(listing, snapshot):
            continue
        steps.append(step)
    return sorted(steps, reverse=True)


@dataclass(frozen=True)
class Fetched:
    """What :func:`fetch_run` brought into ``local``."""

    local: Path
    files: int
    bytes: int
    checkpoint: int | None          # the step fetched, or None
    skipped_checkpoints: tuple[int, ...]   # remote ones newer than it (all: none fetched)


def manifests(remote: Remote, listing: Mapping[str, int]) -> dict[int, dict[str, Any]]:
    """Each remote checkpoint's manifest, by step; an unreadable one is left out."""
    out: dict[int, dict[str, Any]] = {}
    for rel in listing:
        match = _STEP.match(rel)
        if match is None:
            continue
        try:
            manifest = json.loads(remote.read_text(rel))
        except (StorageError, FileNotFoundError, ValueError) as exc:
            log.warning("storage: %s unreadable (%s); not using that checkpoint", rel, exc)
            continue
        if isinstance(manifest, dict):
            out[int(match.group(1))] = manifest
    return out


def fetch_run(remote: Remote, local: Path, *, checkpoint: str = "resume",
              step: int | None = None, journal: bool = True) -> Fetched:
    """Download the run at ``remote`` into the new directory ``local``.

    ``checkpoint``: ``"resume"`` fetches the newest checkpoint the remote journal reaches
    (:func:`usable_checkpoints`), ``"newest"`` the newest complete one (or ``step``'s),
    ``"all"`` every file under ``checkpoints/`` as it is (for a verification of them),
    ``"none"`` none.  Every other file comes too (the journal only with ``journal``).
    StorageError when ``remote`` holds no erlay run, or no usable checkpoint was asked for
    and none exists; FileExistsError when ``local`` holds files."""
    listing = remote.listing()
    if "config.yaml" not in listing:
        raise StorageError(f"{remote.url} is not an erlay run directory (no config.yaml)")
    if local.exists() and any(local.iterdir()):
        raise FileExistsError(f"{local} is not empty")
    chosen: int | None = None
    skipped: tuple[int, ...] = ()
    found: dict[int, dict[str, Any]] = {}
    if checkpoint not in ("none", "all"):
        found = manifests(remote, listing)
        usable = usable_checkpoints(listing, found, with_journal=checkpoint == "resume")
        if step is not None:
            if step not in usable:
                raise StorageError(f"{remote.url} holds no complete checkpoint of step {step} "
                                   f"(complete: {', '.join(map(str, usable)) or 'none'})")
            chosen = step
        elif usable:
            chosen = usable[0]
        elif checkpoint == "newest":
            raise StorageError(f"{remote.url} holds no complete checkpoint")
        skipped = tuple(s for s in sorted(found, reverse=True) if chosen is None or s > chosen)
    wanted = {rel: size for rel, size in listing.items()
              if (checkpoint == "all" or _wanted(rel, chosen, journal))
              and not rel.startswith(".erlay-probe-")}
    # The checkpoint's manifest last, as the mirror uploads it: a fetch cut short leaves no
    # local step-* that looks complete.
    order = sorted(wanted, key=lambda r: r.endswith(f"/{MANIFEST}") and
                   r.startswith("checkpoints/"))
    total = 0
    for rel in order:
        total += remote.get(rel, local / rel)
    log.info("storage: fetched %d file(s), %d bytes, from %s into %s%s", len(order), total,
                remote.url, local, f" (checkpoint of step {chosen})" if chosen is not None
                else "")
    return Fetched(local, len(order), total, chosen, skipped)


def _wanted(rel: str, checkpoint: int | None, journal: bool) -> bool:
    if rel.startswith("checkpoints/"):
        return checkpoint is not None and rel.startswith(f"checkpoints/step-{checkpoint:08d}/")
    if rel.startswith("journal/"):
        return journal
    return True


def retire_checkpoints(remote: Remote, steps: tuple[int, ...]) -> None:
    """Remove the remote checkpoints of ``steps``, each manifest first (a reader never takes
    a half-removed one for complete): a resume that restores an older step retires the
    newer ones its journal does not reach, so that no learner restores them later."""
    listing = remote.listing("checkpoints")
    for step in steps:
        prefix = f"checkpoints/step-{step:08d}/"
        remote.delete(prefix + MANIFEST)
        for rel in sorted(r for r in listing if r.startswith(prefix) and
                          not r.endswith(MANIFEST)):
            remote.delete(rel)

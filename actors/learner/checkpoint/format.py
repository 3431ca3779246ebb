"""The on-disk format of learner checkpoints: writing one checkpoint directory, and finding,
checking and loading complete ones.  :mod:`erlay.actors.learner.checkpoint` runs the writing in a
background worker and commits directories into place.

A checkpoint is a directory ``root/step-XXXXXXXX`` holding ``state.pt`` (``torch.save`` of
the state) and ``manifest.json``: format, step, creation time, each file's size and sha256,
and ``extra`` (small JSON metadata such as a journal snapshot name).  A *sharded* checkpoint
(:mod:`erlay.actors.learner.checkpoint.sharded`) has the same manifest plus ``"layout":
"sharded"`` and the ``world_size`` it was saved with, and holds a ``torch.distributed.checkpoint``
directory (``.metadata`` and one ``__<rank>_0.distcp`` file per rank) and one ``rank-XXXXX.pt``
per rank instead of ``state.pt``; :func:`list_checkpoints` and :func:`latest` see both layouts,
:func:`load` reads only the replicated one.  It is complete exactly
when the manifest is valid, names the directory's step, and every file it lists exists with
the recorded size.  Directories are written under a ``.tmp-`` name and renamed into place
only once complete (:mod:`erlay.actors.learner.checkpoint.commit`).  A reader needs to know
one thing about writers: where a re-save cannot swap directories atomically, the old
checkpoint is renamed aside to ``.old-step-XXXXXXXX-<nonce>`` for a moment, and while
``step-XXXXXXXX`` is missing that aside *is* the step's checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from erlay.supervisor.errors import ErlayError
from erlay.supervisor.failpoints import failpoint

log = logging.getLogger("erlay.checkpoint")

CHECKPOINT_FORMAT = 1
MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
REPLICATED, SHARDED = "replicated", "sharded"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a sharded checkpoint
TMP_PREFIX = ".tmp-"
# An old checkpoint being removed by retention: renamed first, so a crash leaves a leftover.
RETIRED_PREFIX = f"{TMP_PREFIX}retired-"
ASIDE_PREFIX = ".old-"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_ASIDE_DIR = re.compile(r"^\.old-(step-\d{8,})-[0-9a-f]+$")


class CheckpointInvalid(ErlayError):
    """``path`` is not a complete, intact checkpoint (``reason`` says what is wrong)."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path} is not a valid checkpoint: {reason}")


# ---------------------------------------------------------------------- reading checkpoints
@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: where it is and what its manifest says."""

    step: int
    path: Path
    files: dict[str, dict[str, Any]]
    extra: dict[str, Any]
    created_unix: float
    layout: str = REPLICATED    # or SHARDED
    world_size: int = 1         # the rank count a sharded checkpoint was saved with

    @property
    def total_bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.files.values())


def step_dir_name(step: int) -> str:
    """``step-XXXXXXXX``: zero-padded so names sort like steps."""
    return f"step-{step:08d}"


def step_of_dir(name: str) -> int:
    """The step of the final directory name ``step-XXXXXXXX``; ValueError for other names."""
    match = _STEP_DIR.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a checkpoint directory name")
    return int(match.group(1))


def aside_name(final_name: str, nonce: str) -> str:
    """Where a re-save puts the old ``final_name`` directory when it cannot swap atomically."""
    return f"{ASIDE_PREFIX}{final_name}-{nonce}"


def aside_target(name: str) -> str | None:
    """The final directory name that the aside ``name`` stands in for, or None."""
    match = _ASIDE_DIR.match(name)
    return match.group(1) if match is not None else None


def read_manifest(path: Path, step: int | None = None) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path``, checked against the files on disk
    (existence and sizes, not checksums).  Raises :class:`CheckpointInvalid`."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointInvalid(path, f"unreadable {MANIFEST}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointInvalid(path, f"manifest format is not {CHECKPOINT_FORMAT}")
    if step is not None and manifest.get("step") != step:
        raise CheckpointInvalid(path, f"manifest says step {manifest.get('step')}, "
                                      f"the directory says {step}")
    layout = manifest.get("layout", REPLICATED)
    if layout not in (REPLICATED, SHARDED):
        raise CheckpointInvalid(path, f"manifest names an unknown layout {layout!r}")
    required = DCP_METADATA if layout == SHARDED else STATE_FILE
    files = manifest.get("files")
    if not isinstance(files, dict) or required not in files:
        raise CheckpointInvalid(path, f"manifest lists no {required}")
    for name, record in files.items():
        try:
            size = (path / name).stat().st_size
        except OSError as exc:
            raise CheckpointInvalid(path, f"{name} is missing") from exc
        if size != record.get("bytes"):
            raise CheckpointInvalid(path, f"{name} has {size} bytes, "
                                          f"the manifest says {record.get('bytes')}")
    return manifest


def list_checkpoints(root: Path) -> list[CheckpointInfo]:
    """The complete checkpoints under ``root``, oldest step first, at most one per step.

    A step's checkpoint is its ``step-*`` directory; only while that name is missing, a
    complete aside of it (module docstring) counts instead.  Anything else there (``.tmp-*``
    directories, asides of steps whose directory exists, directories without a valid
    manifest) is ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    entries = sorted(root.iterdir())
    names = {entry.name for entry in entries}
    found: list[CheckpointInfo] = []
    steps: set[int] = set()
    for entry in entries:
        name = entry.name
        target = aside_target(name)
        if target is not None and target not in names:
            name = target  # the final name is missing: a re-save was cut between renames
        match = _STEP_DIR.match(name)
        if match is None or not entry.is_dir() or int(match.group(1)) in steps:
            continue
        try:
            manifest = read_manifest(entry, int(match.group(1)))
        except CheckpointInvalid as exc:
            log.warning("ignoring incomplete checkpoint: %s", exc)
            continue
        steps.add(manifest["step"])
        found.append(CheckpointInfo(step=manifest["step"], path=entry, files=manifest["files"],
                                    extra=manifest.get("extra") or {},
                                    created_unix=float(manifest.get("created_unix", 0.0)),
                                    layout=manifest.get("layout", REPLICATED),
                                    world_size=int(manifest.get("world_size", 1))))
    return sorted(found, key=lambda info: info.step)


def latest(root: Path) -> CheckpointInfo | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def load(path: Path, *, verify: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(state, extra)`` of the checkpoint directory ``path``: tensors on the CPU, as plain
    contiguous tensors.  With ``verify`` the files' sha256 must match the manifest (one extra
    read, mostly from the page cache).  Raises :class:`CheckpointInvalid`."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest.get("layout", REPLICATED) == SHARDED:
        raise CheckpointInvalid(path, f"it is a sharded checkpoint (saved on "
                                      f"{manifest.get('world_size')} ranks); load it with "
                                      f"erlay.actors.learner.checkpoint.sharded.load_sharded")
    if verify:
        verify_files(path, manifest)
    # weights_only: a checkpoint is data; loading one must not run code.
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    return state, manifest.get("extra") or {}


def verify_files(path: Path, manifest: dict[str, Any]) -> None:
    """Check every file the manifest lists against its recorded sha256 (one full read).
    Raises :class:`CheckpointInvalid`."""
    for name, record in manifest["files"].items():
        digest = _sha256_of(path / name)
        if digest != record.get("sha256"):
            raise CheckpointInvalid(path, f"{name} has sha256 {digest}, "
                                          f"the manifest says {record.get('sha256')}")


# ------------------------------------------------------------------------------- writing
def write_checkpoint_dir(directory: Path, step: int, state: Any,
                         extra: dict[str, Any]) -> None:
    """Write a complete checkpoint of ``state`` into the new directory ``directory``.

    ``state.pt`` first, then the manifest, each fsynced, then the directory itself.  Raises
    whatever the file system raises; what is left is then incomplete (no valid manifest), or
    complete under a name the caller has not committed yet.  Failpoints mark the stages a
    kill test strikes: ``learner.checkpoint_write`` after each write into ``state.pt``,
    ``learner.checkpoint_fsync`` once it is written, before the first fsync.
    """
    directory.mkdir()
    with open(directory / STATE_FILE, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(state, cast(Any, writer))  # torch.save needs only write()
        f.flush()
        failpoint("learner.checkpoint_fsync")
        os.fsync(f.fileno())
    manifest = {"format": CHECKPOINT_FORMAT, "step": step, "created_unix": time.time(),
                "files": {STATE_FILE: {"bytes": writer.bytes,
                                       "sha256": writer.sha256.hexdigest()}},
                "extra": extra}
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(directory)


class _HashingWriter:
    """A write-only file wrapper that counts and hashes what passes through, so the manifest's
    checksum costs no second read."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._f.write(view)
        self.sha256.update(view)
        self.bytes += view.nbytes
        failpoint("learner.checkpoint_write")
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    """The hex sha256 of the file ``path``."""
    return _sha256_of(path)


def _sha256_of(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
    return sha.hexdigest()

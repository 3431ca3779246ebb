"""Committing a finished checkpoint directory into place, and putting a root back in order
after a crash.  :mod:`erlay.actors.learner.checkpoint` calls :func:`commit_dir` when a save
finalizes and :func:`recover_root` when a checkpointer starts.

The invariant: **once a step has a complete checkpoint, it has one at every instant**, under
its final name ``step-XXXXXXXX`` or, for a moment on the fallback path below, under an aside
name ``.old-step-XXXXXXXX-<nonce>`` that every reader takes for it while the final name is
missing (:func:`~erlay.actors.learner.checkpoint.format.list_checkpoints`).  A crash at any
point of a commit therefore leaves the old checkpoint of that step or the new one, never
neither and never a half-written one.

- **A first save** of a step is one ``rename(tmp, final)`` and an fsync of the root.
- **A re-save** (a run resumed before a step it had checkpointed) swaps the directories: on
  Linux ``renameat2(RENAME_EXCHANGE)`` exchanges ``tmp`` and ``final`` atomically, the root
  is fsynced, and only then is ``tmp``, which now holds the old checkpoint, removed.  Where
  the exchange is not available (no ``renameat2``, or the file system answers ENOSYS, EINVAL
  or ENOTSUP), ``final`` is renamed aside, ``tmp`` renamed to ``final``, the root fsynced and
  the aside removed; a crash between the two renames leaves only the aside, which readers
  use and the next checkpointer renames back.
- **A failed fsync** of the root undoes the swap (best effort) and raises: the save is not
  committed, because it is not known to be durable.  Whatever is left under ``tmp`` is then
  the new checkpoint or nothing, and the caller may remove it.

Each step of a commit has a failpoint, so a test can crash a real process there:
``learner.checkpoint_before_swap`` (the new directory is complete and fsynced, nothing is
renamed yet), ``learner.checkpoint_mid_swap`` (fallback only: the old directory is aside,
the final name is missing), ``learner.checkpoint_after_swap`` (the new directory has the
final name, the root is not fsynced yet) and ``learner.checkpoint_before_cleanup`` (a
re-save is durable, the old directory is not removed yet).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from erlay.actors.learner.checkpoint.format import (
    RETIRED_PREFIX,
    TMP_PREFIX,
    CheckpointInvalid,
    aside_name,
    aside_target,
    fsync_dir,
    list_checkpoints,
    read_manifest,
    step_of_dir,
)
from erlay.supervisor.failpoints import failpoint

__all__ = ["commit_dir", "exchange", "recover_root", "retire"]

log = logging.getLogger("erlay.checkpoint")

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# What a kernel or file system without RENAME_EXCHANGE answers; anything else is a real error.
_NO_EXCHANGE = (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP)


def _load_renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None  # not Linux, or a libc older than glibc 2.28
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Atomically exchange the paths ``a`` and ``b`` (both must exist); True when done,
    False when this system cannot exchange (nothing was changed).  Raises OSError for any
    other failure."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def commit_dir(tmp: Path, final: Path) -> None:
    """Give the complete, fsynced checkpoint directory ``tmp`` the name ``final`` (a sibling),
    durably, replacing a checkpoint already there; see the module docstring for the steps
    and their crash safety.  Raises OSError when the commit did not happen or is not known
    to be durable; ``tmp`` then holds the new checkpoint or nothing."""
    root = final.parent
    failpoint("learner.checkpoint_before_swap")
    if not final.exists():
        os.rename(tmp, final)
        failpoint("learner.checkpoint_after_swap")
        _fsync_or_undo(root, undo=lambda: os.rename(final, tmp))
        return
    if exchange(tmp, final):
        failpoint("learner.checkpoint_after_swap")
        _fsync_or_undo(root, undo=lambda: exchange(tmp, final))
        old = tmp
    else:
        old = root / aside_name(final.name, secrets.token_hex(4))
        os.rename(final, old)
        failpoint("learner.checkpoint_mid_swap")
        os.rename(tmp, final)
        failpoint("learner.checkpoint_after_swap")

        def undo() -> None:
            os.rename(final, tmp)
            os.rename(old, final)
        _fsync_or_undo(root, undo=undo)
    failpoint("learner.checkpoint_before_cleanup")
    shutil.rmtree(old, ignore_errors=True)  # a leftover is removed by recover_root


def _fsync_or_undo(root: Path, undo: Callable[[], object]) -> None:
    try:
        fsync_dir(root)
    except OSError:
        try:
            undo()
        except OSError as exc:
            # The final name still holds a complete checkpoint, the new one.
            log.error("could not undo a commit under %s after its fsync failed: %s", root, exc)
        raise


def recover_root(root: Path) -> None:
    """Put ``root`` back in order after a crash, before anything writes there again.

    An aside whose final name is missing is the step's committed checkpoint (a crash struck
    between the fallback's two renames): it is renamed back.  Every other aside and every
    ``.tmp-*`` directory (an interrupted save, or an old checkpoint not yet removed) is
    removed.  Only one checkpointer may use a root at a time.
    """
    restored = False
    for entry in sorted(root.iterdir()):
        target = aside_target(entry.name)
        if target is not None and not (root / target).exists():
            try:
                read_manifest(entry, step_of_dir(target))
            except CheckpointInvalid as exc:
                log.warning("removing %s, not a complete checkpoint: %s", entry, exc.reason)
            else:
                log.warning("restoring %s as %s: a re-save was interrupted", entry.name, target)
                os.rename(entry, root / target)
                restored = True
                continue
        if target is not None or entry.name.startswith(TMP_PREFIX):
            log.info("removing %s, left by an interrupted save", entry)
            shutil.rmtree(entry, ignore_errors=True)
    if restored:
        fsync_dir(root)


def retire(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints under ``root``.  Each is first renamed
    to a ``.tmp-retired-`` name, atomically, so a crash mid-removal leaves a leftover that the
    next checkpointer removes, never a half-deleted ``step-*`` directory (failpoint
    ``learner.checkpoint_retire``: renamed, not removed yet)."""
    for old in list_checkpoints(root)[:-keep]:
        log.info("removing checkpoint %s (keeping %d)", old.path, keep)
        retired = root / f"{RETIRED_PREFIX}{old.path.name}-{secrets.token_hex(4)}"
        try:
            os.rename(old.path, retired)
        except OSError as exc:
            log.warning("could not retire checkpoint %s: %s", old.path, exc)
            continue
        failpoint("learner.checkpoint_retire")
        shutil.rmtree(retired, ignore_errors=True)

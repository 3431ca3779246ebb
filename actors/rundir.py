"""The run directory: everything a run leaves behind, readable after a crash.

Where it goes (:meth:`RunDir.create_for`): exactly ``run.run_dir`` when set; else
``<storage>/<name>-<YYYYmmdd-HHMMSS>``, with ``storage`` from ``run.storage``, else
``$ERLAY_STORAGE``, else ``~/erlay-runs``: a stable place outside Ray's temporary directories,
which ``ray job submit``'s copy of the working directory is one of.

    <storage>/<name>-<YYYYmmdd-HHMMSS>/     (or run.run_dir)
        config.yaml      the resolved configuration
        metrics.jsonl    one object per warm start / RL step, flushed as written
        events.jsonl     every supervisor event (starts, exits, restarts, escalations)
        summary.md       status, reward, throughput, restarts by domain
        reward_curve.png the reward per step
        telemetry/       OpenTelemetry spans (one spans-*.jsonl per process) and the
                         driver's metrics, with the default file exporter
        journal/, checkpoints/   the rollout journal and the learner's checkpoints
        report/          ``erlay report``'s Markdown and plots, when asked for

With remote storage (``run.storage=s3://bucket/prefix``) the run works in a local copy,
``<staging>/<name>-<YYYYmmdd-HHMMSS>``, and :attr:`RunDir.remote` names its remote home,
``<storage>/<name>-<YYYYmmdd-HHMMSS>``; the mirrors (:mod:`erlay.actors.storage.mirror`) upload
the copy there in the background.

Only the layout, shared by every room: the summary and the reward plot are written by
:mod:`erlay.actors.observe.summary`.

May import: erlay.supervisor, erlay.actors.storage.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from erlay.actors.storage.remote import Remote, is_remote, open_remote
from erlay.supervisor.errors import ErlayError

STORAGE_ENV = "ERLAY_STORAGE"
DEFAULT_STORAGE = "~/erlay-runs"
DEFAULT_STAGING = "~/erlay-runs/staging"


class RunDirError(ErlayError):
    """The configured run directory cannot be used; the message says why and what to set."""


def expand_path(raw: str, env: Mapping[str, str], cwd: Path) -> Path:
    """``raw`` as an absolute path: ``~`` is ``env['HOME']``, a relative path is under
    ``cwd``.  Not resolved: a symlinked shared mount keeps the name the user gave."""
    if raw == "~" or raw.startswith("~/"):
        home = env.get("HOME") or str(Path.home())
        raw = home + raw[1:]
    path = Path(raw)
    return path if path.is_absolute() else cwd / path


def storage_root(storage: str | None, env: Mapping[str, str], cwd: Path) -> Path:
    """The local directory auto-named run directories go under: ``storage``, else
    ``env[ERLAY_STORAGE]``, else ``~/erlay-runs``; with remote storage (:func:`remote_storage`),
    the staging root instead."""
    raw = storage or env.get(STORAGE_ENV) or DEFAULT_STORAGE
    if is_remote(raw):
        raw = DEFAULT_STAGING
    return expand_path(raw, env, cwd)


def remote_storage(storage: str | None, env: Mapping[str, str]) -> str | None:
    """The object-store URL auto-named run directories go under (``storage``, else
    ``env[ERLAY_STORAGE]``), or None for local storage."""
    raw = storage or env.get(STORAGE_ENV)
    return raw if is_remote(raw) else None


def check_exact(path: Path) -> None:
    """``path`` may become one run's directory: it does not exist, or is an empty directory.
    Otherwise :class:`RunDirError` says what to do instead (resume the run it holds, or name
    the parent of auto-named runs with ``run.storage``, what ``run.run_dir`` used to be)."""
    if not path.exists():
        return
    if not path.is_dir():
        raise RunDirError(f"run.run_dir {path} exists and is not a directory")
    if (path / "config.yaml").is_file():
        raise RunDirError(f"run.run_dir {path} already holds a run; continue it with "
                          f"`erlay run --resume {path}`, or give a new directory")
    if any(path.iterdir()):
        raise RunDirError(f"run.run_dir {path} is not empty; run.run_dir names one run's "
                          f"directory exactly. For a parent of auto-named run directories, "
                          f"set run.storage={path}")


def run_location(storage: str | None, run_dir: str | None,
                 env: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> tuple[Path, bool]:
    """Where a run's directory goes, checked, nothing created: ``(path, True)`` for the
    exact ``run_dir``, ``(parent, False)`` for an auto-named one under the storage root.
    ``env`` and ``cwd`` default to the process's.  Raises :class:`RunDirError` for a
    ``run_dir`` that is not new or empty, and for a remote ``ERLAY_STORAGE``."""
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    if run_dir:
        path = expand_path(run_dir, env, cwd)
        check_exact(path)
        return path, True
    return storage_root(storage, env, cwd), False


def in_ray_working_dir(path: Path, cwd: Path) -> bool:
    """Whether ``path`` lies in Ray's temporary copy of a job's working directory (``cwd``
    under ``.../runtime_resources/working_dir_files/``), which Ray deletes with the job."""
    if "working_dir_files" not in cwd.parts:
        return False
    return path == cwd or cwd in path.parents


class RunDir:
    def __init__(self, path: Path, remote: Remote | None = None) -> None:
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # The run's remote home, when run.storage is an object store: this directory is
        # then the local working copy the mirrors upload.
        self.remote = remote

    @property
    def location(self) -> str:
        """Where the run lives, as a user names it: the remote URL, else the local path."""
        return self.remote.url if self.remote is not None else str(self.path)

    @staticmethod
    def create(parent: str | Path, name: str) -> RunDir:
        """A new ``<parent>/<name>-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``... when taken).  The
        directory is claimed by an exclusive mkdir, so two jobs starting in the same second
        on a shared storage each get their own."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = Path(parent) / f"{name}-{stamp}"
        Path(parent).mkdir(parents=True, exist_ok=True)
        path, n = base, 1
        while True:
            try:
                path.mkdir()
                return RunDir(path)
            except FileExistsError:
                n += 1
                path = Path(f"{base}-{n}")

    @staticmethod
    def create_for(name: str, storage: str | None = None, run_dir: str | None = None,
                   env: Mapping[str, str] | None = None, cwd: Path | None = None,
                   staging: str | None = None) -> RunDir:
        """The run directory a config asks for (``run.name``, ``run.storage``,
        ``run.run_dir``, ``run.staging``), created, with an absolute path.  With remote
        storage, a local copy under the staging root whose name no remote run has taken;
        nothing is written remotely yet.  ``env`` and ``cwd`` default to the process's.
        Raises :class:`RunDirError` as :func:`run_location` does, and
        :class:`~erlay.actors.storage.remote.StorageError` when the store does not answer."""
        env = os.environ if env is None else env
        cwd = Path.cwd() if cwd is None else cwd
        url = None if run_dir else remote_storage(storage, env)
        if url is None:
            path, exact = run_location(storage, run_dir, env, cwd)
            return RunDir(path) if exact else RunDir.create(path, name)
        remote = open_remote(url)
        local_root = expand_path(staging or DEFAULT_STAGING, env, cwd)
        while True:
            local = RunDir.create(local_root, name)
            home = remote.child(local.path.name)
            if not home.exists("config.yaml"):   # else taken by a run on another machine
                local.remote = home
                return local

    @staticmethod
    def open(path: str | Path, remote: Remote | None = None) -> RunDir:
        """An existing run directory, to resume.  Raises FileNotFoundError naming what is
        missing.  A torn last line of ``metrics.jsonl`` or ``events.jsonl`` (the driver died
        mid-write) is cut, so the resumed run's lines follow whole ones."""
        run = Path(path)
        if not (run / "config.yaml").is_file():
            raise FileNotFoundError(f"{run} is not an erlay run directory (no config.yaml)")
        rd = RunDir(run, remote)
        for jsonl in (rd.metrics, rd.events):
            data = jsonl.read_bytes() if jsonl.exists() else b""
            if data and not data.endswith(b"\n"):
                with open(jsonl, "r+b") as f:
                    f.truncate(data.rfind(b"\n") + 1)
        return rd

    @property
    def journal(self) -> Path:
        return self.path / "journal"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def ledger(self) -> Path:
        """The learner's record of what it trained (:mod:`erlay.actors.learner.ledger`)."""
        return self.path / "ledger.jsonl"

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.md"

    @property
    def reward_plot(self) -> Path:
        return self.path / "reward_curve.png"

    def append_metrics(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=str)
        with self._lock, open(self.metrics, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        out = []
        for line in self.metrics.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line after a crash
        return out

    def rl_steps(self) -> list[dict[str, Any]]:
        return [m for m in self.read_metrics() if m.get("phase") == "rl"]

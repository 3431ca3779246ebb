"""``erlay status``: a running job's live supervision tree, read without joining the cluster.

The tree lives in the job's driver, and a Ray driver cannot serve calls, so the driver
*publishes* into the cluster's GCS key-value store, and readers read it with a bare GCS
client (as ``ray status`` does), never with ``ray.init``: a reader registers no Ray job::

    driver (Job.run)                              any machine that reaches the cluster
    ├── tree          (event-loop thread)
    └── StatusPublisher (daemon thread)  ──►  GCS KV  ◄──  erlay status (GcsClient)
          every ~1 s: tree.snapshot()         "erlay" / "status/<ray job id>"
          plus a job summary                  + GCS job table (alive? identity metadata)

Contracts:

- **Identity.**  A run has a name (``run.name``) and an id (its run directory's name).  The
  driver's Ray job carries both, with the run directory and the config path, as job
  metadata (:func:`identity_metadata`, keys ``erlay_*``), so ``ray job list`` shows them;
  Ray merges a ``ray job submit``'s own metadata over it, which leaves these keys alone.
  The published snapshot repeats the identity (a driver that attached to an already
  initialised Ray has no say in its metadata), and ``RUN_DIR/status.json`` records the
  cluster address and Ray job id, so ``erlay status RUN_DIR`` finds the job.
- The publisher never raises into the job.  A snapshot that fails (the tree is restarting, a
  host does not answer) skips that tick; the snapshot's age then grows, and readers mark it
  stale after ``STALE_INTERVALS`` intervals (:mod:`~erlay.actors.observe.status_view`, which
  holds the pure view and rendering).  Ages are the reader's clock minus the publisher's
  (``published_at``): clocks skewed across machines skew the age.
- The publisher starts before the tree boots and, when the job ends, publishes the outcome
  as the last snapshot; the entry stays (a few kB per job) so a finished job still shows
  how it ended.  Whether a job runs is the GCS job table's word (``is_dead``), not the
  entry's: a driver that died without a word is shown as ended.
- Selection never guesses: one running erlay job is shown; several are listed with the
  flag to pass (exit 2).
- A reader names the cluster by its GCS (``host:port``, ``auto``) or, as ``ray job submit``
  users do, by its dashboard (``http://HEAD:8265``), whose node summary names the GCS
  (:mod:`~erlay.actors.observe.dashboard`); either way the reads go to the GCS.

The shell (publisher, GCS reads, :func:`cli_status`) talks to Ray; the decisions (which job
a reader means, what the view holds, how it renders) are pure functions, below and in
:mod:`~erlay.actors.observe.status_view`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from erlay.actors.config import JobConfig
from erlay.actors.observe.dashboard import (
    DashboardError,
    dashboard_base,
    is_dashboard_url,
    locate_gcs,
)
from erlay.actors.observe.status_view import (
    PUBLISH_INTERVAL_S,
    render_json,
    render_text,
    status_view,
)
from erlay.actors.rundir import RunDir
from erlay.supervisor.tree import SupervisionTree

log = logging.getLogger("erlay.status")

NAMESPACE = "erlay"
KEY_PREFIX = "status/"
RUN_FILE = "status.json"       # in the run directory: where its job runs
META_PREFIX = "erlay_"         # Ray job metadata keys: erlay_run_name, erlay_run_id, ...
SCHEMA = 2
GCS_TIMEOUT_S = 3.0          # a reader's GCS call; past it the cluster is taken as gone
CLEAR = "\x1b[H\x1b[2J"     # cursor home, clear screen (for --watch)


def identity_metadata(name: str, run_id: str, run_dir: str | Path,
                      config: str | Path | None) -> dict[str, str]:
    """The Ray job metadata that names an erlay run (string values, as Ray requires)."""
    return {f"{META_PREFIX}run_name": name, f"{META_PREFIX}run_id": run_id,
            f"{META_PREFIX}run_dir": str(run_dir),
            f"{META_PREFIX}config": str(config) if config else ""}


def status_key(job_id: str) -> str:
    """The KV key (namespace :data:`NAMESPACE`) of the Ray job ``job_id``'s snapshot."""
    return f"{KEY_PREFIX}{job_id}"


# ============================================================================ the shell

def _kv_put(key: str, value: str) -> None:
    """Store one snapshot, bounded by :data:`GCS_TIMEOUT_S`.

    Bounded because an unbounded put still pending when the driver shuts Ray down retries
    against the dead GCS, and after 60 s Ray's client ends the whole process ("Failed to
    connect to GCS within 60 seconds"): in a test session, that was pytest itself."""
    from ray.experimental import internal_kv
    client = internal_kv.internal_kv_get_gcs_client()
    if client is None:
        raise RuntimeError("Ray is not initialised in this process")
    client.internal_kv_put(key.encode(), value.encode(), True, NAMESPACE.encode(),
                           timeout=GCS_TIMEOUT_S)


class JobView(Protocol):
    """What ``erlay status`` publishes of a running job (the driver's ``Job`` is one)."""

    cfg: JobConfig
    run_dir: RunDir
    last_metrics: dict[str, Any] | None
    last_rl_metrics: dict[str, Any] | None

    @property
    def restart_count(self) -> int:
        """Restarts in the job's tree so far."""
        ...

    @property
    def control_summary(self) -> dict[str, Any] | None:
        """The goodput controller's actions so far and its latest (None when it is off)."""
        ...


class StatusPublisher:
    """Publishes ``collect()`` under this driver's Ray job every ``interval_s`` seconds.

    ``start``, ``finish`` and ``stop`` never raise: a job whose status cannot be published
    still runs.  ``stop`` is idempotent and safe before ``start``."""

    def __init__(self, collect: Callable[[], dict[str, Any]],
                 interval_s: float = PUBLISH_INTERVAL_S, run_dir: Path | None = None) -> None:
        self.collect = collect
        self.interval_s = interval_s
        self.run_dir = run_dir
        self.key: str | None = None
        self.published = 0
        self.last_doc: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def for_job(job: JobView, tree: SupervisionTree,
                interval_s: float = PUBLISH_INTERVAL_S) -> StatusPublisher:
        """A publisher of ``job``'s summary and ``tree``'s snapshot (see :func:`job_doc`)."""
        started = time.monotonic()
        return StatusPublisher(lambda: job_doc(job, tree, started, interval_s), interval_s,
                               job.run_dir.path)

    def start(self) -> None:
        try:
            import ray
            ctx = ray.get_runtime_context()
            job_id = ctx.get_job_id()
            self.key = status_key(job_id)
            if self.run_dir is not None:
                record = {"address": ctx.gcs_address, "job_id": job_id,
                          "key": self.key, "namespace": NAMESPACE}
                (self.run_dir / RUN_FILE).write_text(json.dumps(record) + "\n",
                                                     encoding="utf-8")
        except Exception as exc:  # noqa: BLE001 - status is optional; the job is not
            log.warning("erlay status: not published for this job (%s: %s)",
                        type(exc).__name__, exc)
            return
        self._thread = threading.Thread(target=self._loop, name="erlay-status", daemon=True)
        self._thread.start()

    def finish(self, status: str, reason: str, exit_code: int, linger_s: float = 0.0) -> None:
        """Publish the job's outcome as its last snapshot (the tree is gone by now, so the
        last one collected is reused).  What ``erlay status`` shows then agrees with the
        exit code.  ``linger_s`` keeps the job alive that long, for watchers to see it."""
        self._halt()
        if self.key is None:
            return
        doc = dict(self.last_doc or {})
        doc["outcome"] = {"status": status, "reason": reason, "exit_code": exit_code}
        doc["published_at"] = time.time()
        try:
            _kv_put(self.key, json.dumps(doc, default=str))
        except Exception as exc:  # noqa: BLE001 - status is optional
            log.debug("erlay status: the outcome was not published: %s", exc)
            return
        if linger_s > 0:
            time.sleep(linger_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._halt(timeout_s)

    def _halt(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def publish_once(self) -> bool:
        """Collect and publish one snapshot; False (logged) if either step failed."""
        try:
            doc = self.collect()
            doc["published_at"] = time.time()
            _kv_put(str(self.key), json.dumps(doc, default=str))
            self.last_doc = doc
        except Exception as exc:  # noqa: BLE001 - e.g. the tree is mid-restart: skip a tick
            log.debug("erlay status: snapshot skipped: %s: %s", type(exc).__name__, exc)
            return False
        self.published += 1
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.publish_once()
            self._stop.wait(self.interval_s)


def job_doc(job: JobView, tree: SupervisionTree, started: float,
            interval_s: float) -> dict[str, Any]:
    """What a job publishes: run identity, a progress summary and the tree snapshot.

    Raises whatever ``tree.snapshot`` raises (the publisher skips that tick)."""
    if not tree.alive:
        raise RuntimeError("the tree has stopped")
    snapshot = tree.snapshot(timeout=5)
    rl = job.last_rl_metrics or {}
    last = job.last_metrics or {}
    return {
        "schema": SCHEMA,
        "interval_s": interval_s,
        "run": {"id": job.run_dir.path.name, "name": job.cfg.run.name,
                "dir": str(job.run_dir.path)},
        "job": {"phase": last.get("phase"), "step": rl.get("step"),
                "steps": job.cfg.run.steps, "reward": rl.get("reward_mean"),
                "restarts": job.restart_count, "control": job.control_summary,
                "uptime_s": round(time.monotonic() - started, 3),
                "driver": {"pid": os.getpid(), "host": socket.gethostname()}},
        "tree": snapshot,
    }


class ClusterGone(Exception):
    """The cluster's GCS does not answer (stopped, unreachable, or refused us)."""


class Cluster:
    """A reader's view of one cluster through a bare GCS client: no ``ray.init``, no job.

    Every call raises :class:`ClusterGone` when the GCS does not answer within
    :data:`GCS_TIMEOUT_S`."""

    def __init__(self, address: str) -> None:
        self.address = address
        if not _reachable(address):
            raise ClusterGone("nothing listens there")
        _local_token_auth(address)
        from ray._raylet import GcsClient
        try:
            self.client = GcsClient(address=address)
        except Exception as exc:  # Ray raises several kinds here
            raise ClusterGone(_first_line(exc)) from exc

    def jobs(self) -> list[JobEntry]:
        """Every Ray job that is an erlay run: erlay metadata, or a published snapshot."""
        try:
            infos = self.client.get_all_job_info(skip_submission_job_info_field=True,
                                                 skip_is_running_tasks_field=True,
                                                 timeout=GCS_TIMEOUT_S)
            published = set(self.client.internal_kv_keys(
                KEY_PREFIX.encode(), namespace=NAMESPACE.encode(), timeout=GCS_TIMEOUT_S))
        except Exception as exc:  # RpcError, TimeoutError, ...
            raise ClusterGone(_first_line(exc)) from exc
        out = []
        for info in infos.values():
            job_id = info.job_id.hex()
            meta = dict(info.config.metadata)
            has_doc = status_key(job_id).encode() in published
            if not has_doc and f"{META_PREFIX}run_id" not in meta:
                continue
            if has_doc and f"{META_PREFIX}run_id" not in meta:
                run = (self.read(job_id) or {}).get("doc", {}).get("run") or {}
                meta.update(identity_metadata(run.get("name", "?"), run.get("id", "?"),
                                              run.get("dir", "?"), None))
            out.append(JobEntry(job_id=job_id, run_id=meta[f"{META_PREFIX}run_id"],
                                name=meta.get(f"{META_PREFIX}run_name", "?"),
                                run_dir=meta.get(f"{META_PREFIX}run_dir", "?"),
                                config=meta.get(f"{META_PREFIX}config", ""),
                                alive=not info.is_dead,
                                submission_id=meta.get("job_submission_id", "")))
        return sorted(out, key=lambda j: j.job_id)

    def alive(self, job_id: str) -> bool:
        return any(j.alive for j in self.jobs() if j.job_id == job_id)

    def read(self, job_id: str) -> dict[str, Any] | None:
        """``{"doc": the last snapshot, "age_s": its age}``, or None before the first one."""
        try:
            raw = self.client.internal_kv_get(status_key(job_id).encode(),
                                              namespace=NAMESPACE.encode(),
                                              timeout=GCS_TIMEOUT_S)
        except Exception as exc:
            raise ClusterGone(_first_line(exc)) from exc
        if not raw:
            return None
        doc = json.loads(raw)
        age = max(0.0, time.time() - float(doc.get("published_at") or time.time()))
        return {"doc": doc, "age_s": round(age, 3)}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().strip("'\"").splitlines()
    return text[0] if text else type(exc).__name__


# ======================================================================== the pure core

@dataclass(frozen=True)
class JobEntry:
    """One erlay run as the cluster knows it."""

    job_id: str               # Ray's job id (hex)
    run_id: str
    name: str
    run_dir: str
    config: str = ""
    alive: bool = True
    submission_id: str = ""   # set under ``ray job submit``

    def names(self) -> tuple[str, ...]:
        """What ``--job`` may name this run by."""
        return tuple(k for k in (self.run_id, self.name, self.job_id, self.submission_id) if k)


@dataclass(frozen=True)
class Choice:
    """Which job to read, or why none: ``exit_code`` 1 (none found), 2 (ambiguous)."""

    job: JobEntry | None
    exit_code: int = 0
    message: str = ""


def choose_job(jobs: list[JobEntry], wanted: str | None, address: str) -> Choice:
    """Pick the job a reader means among ``jobs``; never guess.

    Without ``wanted``: the only running one, else exit 2 listing the running ones (or exit 1
    when none runs).  With ``wanted`` (a run id, run name, Ray job id or submission id):
    exact matches first, then run ids that start with it; running jobs are preferred over
    ended ones; still more than one is exit 2 with the list."""
    running = [j for j in jobs if j.alive]
    if wanted is None:
        if len(running) == 1:
            return Choice(running[0])
        if not running:
            return Choice(None, 1, f"erlay: no running erlay job found at {address}")
        return Choice(None, 2, _listing(f"erlay: {len(running)} erlay jobs run at {address}; "
                                        "pick one with --job NAME_OR_ID (or give its RUN_DIR):",
                                        running))
    matches = ([j for j in jobs if wanted in j.names()]
               or [j for j in jobs if j.run_id.startswith(wanted)])
    if len(matches) > 1 and any(j.alive for j in matches):
        matches = [j for j in matches if j.alive]
    if len(matches) == 1:
        return Choice(matches[0])
    if not matches:
        return Choice(None, 1, _listing(f"erlay: no erlay job {wanted!r} found at {address}; "
                                        "its jobs:", jobs) if jobs else
                      f"erlay: no erlay job {wanted!r} found at {address}")
    return Choice(None, 2, _listing(f"erlay: --job {wanted!r} matches {len(matches)} jobs at "
                                    f"{address}; pick one by its ID:", matches))


LISTING = ("NAME", "ID", "RAY JOB", "STATE", "RUN DIR")


def _listing(head: str, jobs: list[JobEntry]) -> str:
    rows = [LISTING, *((j.name, j.run_id, j.job_id, "running" if j.alive else "ended",
                        j.run_dir) for j in jobs)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(LISTING))]
    lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    return "\n".join([head, *lines])


def jobs_json(jobs: list[JobEntry]) -> list[dict[str, Any]]:
    return [asdict(j) for j in jobs]


# ========================================================================= the command

def _reachable(address: str, timeout_s: float = 2.0) -> bool:
    """False if ``address`` is a ``host:port`` that refuses TCP; anything else (``auto``,
    ``ray://``) is left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in host:
        return True
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def _local_token_auth(address: str) -> None:
    """Send this machine's Ray token to a loopback ``address``, as Ray does for ``auto``.

    Ray 2.60 enables token auth on the local clusters it starts (token in ~/.ray), and
    uses the token for clusters it finds itself (``auto``) but never for an explicit
    address unless RAY_AUTH_MODE=token.  A loopback address is this machine's own cluster,
    so it gets what ``auto`` would; a remote one still needs RAY_AUTH_MODE set by the user.
    The hook is Ray's private one; without it nothing changes."""
    if "RAY_AUTH_MODE" in os.environ or address.rpartition(":")[0] not in LOOPBACK_HOSTS:
        return
    try:
        from ray._private.authentication import authentication_token_setup as setup
    except ImportError:
        return
    quiet = logging.getLogger(setup.__name__)  # it warns "token auth is enabled" on stderr
    level, quiet.level = quiet.level, logging.ERROR
    try:
        setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        quiet.setLevel(level)


def _dashboard_headers(base: str) -> dict[str, str]:
    """The token header Ray's own job client would send to the dashboard at ``base`` (a
    loopback one gets this machine's token, as :func:`_local_token_auth` says)."""
    parts = urlsplit(base)
    _local_token_auth(f"{parts.hostname}:{parts.port}")
    try:
        from ray._private.authentication.http_token_authentication import (
            get_auth_headers_if_auth_enabled,
        )
    except ImportError:
        return {}
    return dict(get_auth_headers_if_auth_enabled({}))


def _resolve(address: str) -> tuple[str, str]:
    """``(host:port of the GCS, how to name it to the user)``; ``auto`` is the cluster this
    machine started last, as Ray finds it; a dashboard URL leads to its cluster's GCS
    (:mod:`~erlay.actors.observe.dashboard`).  Raises :class:`ClusterGone` if there is none."""
    if is_dashboard_url(address):
        try:
            base = dashboard_base(address)
            candidates = locate_gcs(base, _dashboard_headers(base))
        except DashboardError as exc:
            raise ClusterGone(str(exc)) from exc
        gcs = next((a for a in candidates if _reachable(a)), candidates[-1])
        return gcs, f"{gcs} (dashboard {base})"
    if address != "auto":
        return address, address
    from ray._private.services import canonicalize_bootstrap_address
    try:
        found = canonicalize_bootstrap_address("auto")
    except Exception as exc:  # ConnectionError: none recorded
        raise ClusterGone(_first_line(exc)) from exc
    if not found:
        raise ClusterGone("no local Ray cluster found")
    return found, f"{found} (auto)"


def _run_record(run_dir: Path) -> dict[str, Any]:
    """What ``RUN_DIR/status.json`` says of the run's job; raises ValueError, for the user."""
    path = run_dir / RUN_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: that run never published its status "
                         "(not an erlay run directory, or its job did not start)") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is unreadable: {exc}") from None
    if not isinstance(record, dict) or not {"address", "job_id"} <= set(record):
        raise ValueError(f"{path} names no cluster address and job id")
    return record


def _read_first(cluster: Cluster, job: JobEntry, wait_s: float = 5.0) -> dict[str, Any] | None:
    """The job's first snapshot, waiting ``wait_s`` for a job that has just started."""
    deadline = time.monotonic() + wait_s
    while True:
        read = cluster.read(job.job_id)
        if read is not None or not job.alive or time.monotonic() > deadline:
            return read
        time.sleep(0.2)


def cli_status(args: argparse.Namespace) -> int:
    """``erlay status``: 0 shown (or, under --watch, the job ended or Ctrl-C), 1 no such job
    or no cluster (or, under --watch, the cluster went away), 2 ambiguous (a list to pick
    from).  Reads through a bare GCS client: registers no Ray job."""
    wanted: str | None = getattr(args, "job", None)
    address: str | None = args.address
    if getattr(args, "run_dir", None):
        try:
            record = _run_record(Path(args.run_dir))
        except ValueError as exc:
            print(f"erlay: {exc}", file=sys.stderr)
            return 1
        address, wanted = address or str(record["address"]), str(record["job_id"])
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    label = address
    try:
        gcs, label = _resolve(address)
        cluster = Cluster(gcs)
        jobs = cluster.jobs()
    except ClusterGone as exc:
        print(f"erlay: no running erlay job found at {label} ({exc})", file=sys.stderr)
        return 1
    choice = choose_job(jobs, wanted, label)
    if choice.job is None:
        if args.json:
            print(json.dumps({"address": label, "error": choice.message.splitlines()[0],
                              "jobs": jobs_json(jobs)}, sort_keys=True))
        print(choice.message, file=sys.stderr)
        return choice.exit_code
    job = choice.job
    try:
        read = _read_first(cluster, job)
    except ClusterGone as exc:
        print(f"erlay: the Ray cluster at {label} went away ({exc})", file=sys.stderr)
        return 1
    if read is None:
        print(f"erlay: job {job.run_id} ({job.job_id}) has not published its tree "
              f"{'yet' if job.alive else 'before it ended'}", file=sys.stderr)
        return 1
    alive = job.alive
    try:
        while True:
            view = status_view(read, address=label, job_id=job.job_id, alive=alive)
            _show(view, args.json, clear=args.watch and sys.stdout.isatty())
            if not args.watch:
                return 0
            if not view["running"]:
                outcome = view["outcome"] or {}
                code = outcome.get("exit_code")
                print(f"erlay: job {job.run_id} ended: {outcome.get('status', '?')} "
                      f"(exit code {'?' if code is None else code})", file=sys.stderr)
                return 0
            time.sleep(max(args.interval, 0.1))
            try:
                if not _reachable(gcs, timeout_s=1.0):
                    raise ClusterGone("nothing listens there any more")
                alive = cluster.alive(job.job_id)
                read = cluster.read(job.job_id) or read
            except ClusterGone as exc:
                print(f"erlay: the Ray cluster at {label} went away ({exc})", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        return 0


def _show(view: dict[str, Any], as_json: bool, *, clear: bool) -> None:
    if as_json:  # under --watch: one object per line
        print(render_json(view), flush=True)
        return
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    text = render_text(view, width)
    print(f"{CLEAR}{text}" if clear else text, flush=True)

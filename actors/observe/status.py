"""``erlay status``: a running job's live supervision tree, read through a named endpoint.

The tree lives in the job's driver, and a Ray driver cannot serve calls, so the driver
*publishes* and readers read from a small actor::

    driver (Job.run)                            any machine that reaches the cluster
    ├── tree          (event-loop thread)
    └── StatusPublisher (daemon thread)  ──►  StatusEndpoint actor  ◄──  erlay status
          every ~1 s: tree.snapshot()           "erlay/status@<run id>"    (read() only)
          plus a job summary                    namespace "erlay"

Contracts:

- The publisher never raises into the job.  A snapshot that fails (the tree is restarting, a
  host does not answer) skips that tick; the snapshot's age then grows, and readers mark it
  stale after :data:`STALE_INTERVALS` intervals.
- The publisher starts before the tree boots (a slow boot shows as it happens) and stops
  when ``Job.run`` ends.  The endpoint is owned by the driver (not detached), so Ray removes
  it when the driver dies, and the publisher kills it when the job ends: a listed endpoint
  is a running job.
- Readers call only :meth:`StatusEndpoint.read`.  The endpoint holds a copy of the last
  snapshot and nothing else: it has no handle on the tree and exposes no control.
- Ages are measured on the endpoint's clock (it stamps each snapshot as it arrives), so a
  reader on another machine with a skewed clock still sees the right age.

The shell (endpoint, publisher, :func:`cli_status`) talks to Ray; the decisions (which
endpoint a reader means, what the view holds, how it renders) are pure functions below.
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
from dataclasses import dataclass
from typing import Any, cast

from erlay.supervisor.errors import ErlayError

log = logging.getLogger("erlay.status")

NAMESPACE = "erlay"
PREFIX = "erlay/status@"
SCHEMA = 1
PUBLISH_INTERVAL_S = 1.0
STALE_INTERVALS = 5          # a snapshot older than this many publish intervals is stale
CLEAR = "\x1b[H\x1b[2J"     # cursor home, clear screen (for --watch)


def endpoint_name(run_id: str) -> str:
    """The Ray actor name of the endpoint of the run whose directory is named ``run_id``."""
    return f"{PREFIX}{run_id}"


# ============================================================================ the shell

class StatusEndpoint:
    """The named actor that holds a job's last published status (wrapped by ``ray.remote``).

    ``publish`` is for the owning driver's publisher; ``read`` is all a reader calls."""

    def __init__(self) -> None:
        self._doc: dict[str, Any] | None = None
        self._received = 0.0

    def publish(self, doc: dict[str, Any]) -> None:
        """Replace the held snapshot, stamping its arrival on this actor's clock."""
        self._doc, self._received = doc, time.monotonic()

    def read(self) -> dict[str, Any] | None:
        """``{"doc": the last snapshot, "age_s": seconds since it arrived}``, or None before
        the first one."""
        if self._doc is None:
            return None
        return {"doc": self._doc, "age_s": round(time.monotonic() - self._received, 3)}


class StatusPublisher:
    """Publishes ``collect()`` to the endpoint named ``name`` every ``interval_s`` seconds.

    ``start`` and ``stop`` never raise: a job whose status cannot be published still runs.
    ``stop`` is idempotent, safe before ``start``, and removes the endpoint."""

    def __init__(self, name: str, collect: Callable[[], dict[str, Any]],
                 interval_s: float = PUBLISH_INTERVAL_S) -> None:
        self.name = name
        self.collect = collect
        self.interval_s = interval_s
        self.endpoint: Any = None
        self.published = 0
        self.last_doc: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def for_job(job: Any, tree: Any, interval_s: float = PUBLISH_INTERVAL_S) -> StatusPublisher:
        """A publisher of ``job``'s summary and ``tree``'s snapshot (see :func:`job_doc`)."""
        started = time.monotonic()
        return StatusPublisher(endpoint_name(job.run_dir.path.name),
                               lambda: job_doc(job, tree, started, interval_s), interval_s)

    def start(self) -> None:
        try:
            self.endpoint = self._create()
        except Exception as exc:  # noqa: BLE001 - status is optional; the job is not
            log.warning("erlay status: no endpoint for this job (%s: %s)",
                        type(exc).__name__, exc)
            return
        self._thread = threading.Thread(target=self._loop, name="erlay-status", daemon=True)
        self._thread.start()

    def finish(self, status: str, reason: str, exit_code: int, linger_s: float = 0.0) -> None:
        """Publish the job's outcome as its last snapshot (the tree is gone by now, so the
        last one collected is reused), then keep the endpoint up ``linger_s`` seconds for
        readers to see it.  What ``erlay status`` shows then agrees with the exit code."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self.endpoint is None:
            return
        import ray
        doc = dict(self.last_doc or {})
        doc["outcome"] = {"status": status, "reason": reason, "exit_code": exit_code}
        try:
            ray.get(self.endpoint.publish.remote(doc), timeout=10)
        except Exception as exc:  # noqa: BLE001 - status is optional
            log.debug("erlay status: the outcome was not published: %s", exc)
            return
        if linger_s > 0:
            time.sleep(linger_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            try:
                import ray
                ray.kill(endpoint)
            except Exception as exc:  # noqa: BLE001 - it dies with the driver anyway
                log.debug("erlay status: killing the endpoint failed: %s", exc)

    def publish_once(self) -> bool:
        """Collect and publish one snapshot; False (logged) if either step failed."""
        import ray
        try:
            doc = self.collect()
            ray.get(self.endpoint.publish.remote(doc), timeout=10)
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

    def _create(self) -> Any:
        import ray
        actor = ray.remote(StatusEndpoint)
        for attempt in range(1, 6):
            name = self.name if attempt == 1 else f"{self.name}#{attempt}"
            try:  # not detached: owned by this driver, so it dies with the job
                handle = actor.options(name=name, namespace=NAMESPACE, num_cpus=0,
                                       max_restarts=0).remote()
            except ValueError:  # the name is taken by another live job's endpoint
                continue
            self.name = name
            return handle
        raise RuntimeError(f"endpoint names {self.name}, {self.name}#2.. are all taken")


def job_doc(job: Any, tree: Any, started: float, interval_s: float) -> dict[str, Any]:
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
                "restarts": job.restarts.restarts,
                "uptime_s": round(time.monotonic() - started, 3),
                "driver": {"pid": os.getpid(), "host": socket.gethostname()}},
        "tree": snapshot,
    }


def find_endpoints() -> list[str]:
    """Names of the status endpoints on the connected cluster, sorted."""
    import ray
    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in named
                  if a.get("namespace") == NAMESPACE and a["name"].startswith(PREFIX))


def read_endpoint(name: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """The endpoint's ``read()``; None before its first snapshot.  Raises
    :class:`EndpointGone` when the endpoint (so the job) is gone."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RaySystemError
    try:
        handle = ray.get_actor(name, namespace=NAMESPACE)
        return cast("dict[str, Any] | None", ray.get(handle.read.remote(), timeout=timeout_s))
    except (ValueError, RayActorError, GetTimeoutError, RaySystemError,
            ConnectionError) as exc:  # no such actor, it died, or its cluster went down
        raise EndpointGone(name) from exc


class EndpointGone(ErlayError):
    """The endpoint no longer answers: its job ended (or its driver died)."""


# ======================================================================== the pure core

@dataclass(frozen=True)
class Choice:
    """Which endpoint to read, or why none: ``exit_code`` 1 (none found), 2 (ambiguous)."""

    name: str | None
    exit_code: int = 0
    message: str = ""


def choose_endpoint(names: list[str], run: str | None, address: str) -> Choice:
    """Pick the endpoint a reader means among ``names``.

    Without ``run``: the only one, else exit 2 listing them.  With ``run``: the run id equal
    to it, else the ids that start with it (``--run arithmetic``), which must be one."""
    ids = [n.removeprefix(PREFIX) for n in names]
    if not ids:
        return Choice(None, 1, f"erlay: no running erlay job found at {address}")
    if run is None:
        if len(ids) == 1:
            return Choice(names[0])
        return Choice(None, 2, _listing(f"erlay: {len(ids)} erlay jobs run at {address}; "
                                        "pick one with --run NAME:", ids))
    matches = [i for i in ids if i == run] or [i for i in ids if i.startswith(run)]
    if len(matches) == 1:
        return Choice(endpoint_name(matches[0]))
    if not matches:
        return Choice(None, 1, _listing(f"erlay: no running erlay job named {run!r} found at "
                                        f"{address}; running:", ids))
    return Choice(None, 2, _listing(f"erlay: --run {run!r} matches {len(matches)} jobs at "
                                    f"{address}; give more of the name:", matches))


def _listing(head: str, ids: list[str]) -> str:
    return "\n".join([head, *(f"  {i}" for i in ids)])


def flatten(tree: dict[str, Any]) -> list[dict[str, Any]]:
    """Every child row of a snapshot, depth first, without the nested ``children`` lists."""
    out: list[dict[str, Any]] = []

    def walk(rows: list[dict[str, Any]]) -> None:
        for row in rows:
            out.append({k: v for k, v in row.items() if k != "children"})
            walk(row.get("children") or [])

    walk(tree.get("children") or [])
    return out


def status_view(read: dict[str, Any], *, address: str, endpoint: str) -> dict[str, Any]:
    """The object ``erlay status --json`` prints, from an endpoint's ``read()``.

    ``job.uptime_s`` is advanced by the snapshot's age; children's ``progress_age_s`` are as
    of the snapshot.  ``stale`` says the driver has not published for STALE_INTERVALS
    intervals (hung, or dying)."""
    doc, age = read["doc"], float(read["age_s"])
    job = dict(doc.get("job") or {})
    if job.get("uptime_s") is not None:
        job["uptime_s"] = round(float(job["uptime_s"]) + age, 3)
    tree = doc.get("tree") or {}
    interval = float(doc.get("interval_s") or PUBLISH_INTERVAL_S)
    return {"address": address, "endpoint": endpoint, "schema": doc.get("schema"),
            "run": doc.get("run") or {}, "job": job, "snapshot_age_s": round(age, 3),
            "stale": age > STALE_INTERVALS * interval and not doc.get("outcome"),
            "tree": tree, "children": flatten(tree) if tree else [],
            "outcome": doc.get("outcome")}


def format_age(seconds: float | None) -> str:
    """``0.4s``, ``12s``, ``3m05s``, ``2h07m``; ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def last_failure(row: dict[str, Any]) -> str:
    """The row's last exit if it was abnormal; ``-`` for none or a normal one (a child
    stopped by a one_for_all restart of its siblings did not fail)."""
    text = row.get("last_exit") or ""
    kind = text.split(":", 1)[0].split(" ", 1)[0]
    return "-" if not text or kind in ("normal", "shutdown") else text


def work_of(row: dict[str, Any]) -> str:
    """``phase work`` of what the child holds, ``idle`` if it reports none, else ``-``."""
    if row.get("phase"):
        return f"{row['phase']} {row['work']}" if row.get("work") else str(row["phase"])
    return "idle" if row.get("progress_age_s") is not None else "-"


COLUMNS = ("STATE", "INC", "RESTARTS", "PID", "PROGRESS", "WORK", "LAST FAILURE")


def header_lines(view: dict[str, Any]) -> list[str]:
    run, job = view["run"], view["job"]
    steps = job.get("steps")
    done = job["step"] + 1 if job.get("step") is not None else 0
    step = f"step {done}/{steps}" if steps is not None else f"step {done}"
    if job.get("phase") not in (None, "rl"):
        step += f" ({str(job['phase']).replace('_', ' ')})"
    reward = f"{job['reward']:.3f}" if job.get("reward") is not None else "-"
    age = format_age(view["snapshot_age_s"])
    stale = "  STALE (driver busy, hung or exiting)" if view["stale"] else ""
    driver = job.get("driver") or {}
    outcome = view.get("outcome")
    ended = ([f"ENDED {outcome['status'].upper()} (exit code {outcome['exit_code']}): "
              f"{outcome['reason']}"] if outcome else [])
    return [*ended, f"run {run.get('id', '?')}  ({run.get('dir', '?')})",
            f"{step}   last reward {reward}   restarts {job.get('restarts', 0)}   "
            f"uptime {format_age(job.get('uptime_s'))}   snapshot {age} old{stale}",
            f"driver pid {driver.get('pid', '?')} on {driver.get('host', '?')}   "
            f"ray {view['address']}"]


def tree_rows(tree: dict[str, Any]) -> list[tuple[str, ...]]:
    """One table row per node: the tree column, then :data:`COLUMNS`."""
    root = (f"{tree.get('path', '?')} [{tree.get('strategy', '?')}]",
            str(tree.get("status", "?")), "", "", "", "", "", "")
    rows: list[tuple[str, ...]] = [root]

    def walk(children: list[dict[str, Any]], prefix: str) -> None:
        for i, row in enumerate(children):
            last = i == len(children) - 1
            name = row["id"] + (f" [{row['strategy']}]" if row.get("strategy") else "")
            pid = (row.get("info") or {}).get("pid")
            watched = row.get("type") != "supervisor" and row.get("watched", True)
            note = f" ({row['children_error']})" if row.get("children_error") else ""
            rows.append((f"{prefix}{'└─ ' if last else '├─ '}{name}",
                         f"{row['status']}{note}", str(row["incarnation"]), str(row["restarts"]),
                         str(pid) if pid else "",
                         format_age(row.get("progress_age_s") if watched else None),
                         work_of(row) if watched else "-", last_failure(row)))
            walk(row.get("children") or [], prefix + ("   " if last else "│  "))

    walk(tree.get("children") or [], "")
    return rows


def render_text(view: dict[str, Any], width: int | None = None) -> str:
    """The human view: a header, then the tree as a table.  Lines are cut to ``width``."""
    table = [("CHILD", *COLUMNS), *tree_rows(view["tree"])] if view["tree"] else []
    lines = [*header_lines(view), ""]
    if table:
        widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
        right = {2, 3, 5}  # INC, RESTARTS, PROGRESS
        for r in table:
            cells = [cell.rjust(widths[c]) if c in right else cell.ljust(widths[c])
                     for c, cell in enumerate(r)]
            lines.append("  ".join(cells).rstrip())
    else:
        lines.append("(no tree in this snapshot)")
    if width:
        lines = [line if len(line) <= width else line[:width - 1] + "…" for line in lines]
    return "\n".join(lines)


def render_json(view: dict[str, Any]) -> str:
    return json.dumps(view, sort_keys=True, default=str)


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


def _connect(address: str) -> str | None:
    """Attach to the cluster at ``address``; None, or why not (for the user)."""
    if not _reachable(address):
        return "nothing listens there"
    from erlay.supervisor.raylocal import ensure_ray
    _local_token_auth(address)
    try:
        ensure_ray(address, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        log.debug("cannot attach to %s: %s", address, exc)
        hint = "" if address == "auto" or os.environ.get("RAY_AUTH_MODE") == "token" else \
            "; a cluster with token authentication also needs RAY_AUTH_MODE=token"
        text = str(exc).strip().strip("'\"").splitlines()
        return f"cannot attach: {text[0] if text else type(exc).__name__}{hint}"
    return None


def _read_first(name: str, wait_s: float = 5.0) -> dict[str, Any] | None:
    """The endpoint's first snapshot, waiting ``wait_s`` for a job that has just started."""
    deadline = time.monotonic() + wait_s
    while True:
        read = read_endpoint(name)
        if read is not None or time.monotonic() > deadline:
            return read
        time.sleep(0.2)


def cli_status(args: argparse.Namespace) -> int:
    """``erlay status``: 0 shown (or Ctrl-C / job end under --watch), 1 no job, 2 ambiguous."""
    address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
    problem = _connect(address)
    if problem is not None:
        print(f"erlay: no running erlay job found at {address} ({problem})", file=sys.stderr)
        return 1
    if address == "auto":  # name the cluster that "auto" found
        import ray
        address = f"{ray.get_runtime_context().gcs_address} (auto)"
    choice = choose_endpoint(find_endpoints(), args.run, address)
    if choice.name is None:
        print(choice.message, file=sys.stderr)
        return choice.exit_code
    run_id = choice.name.removeprefix(PREFIX)
    try:
        read = _read_first(choice.name)
    except EndpointGone:
        print(f"erlay: job {run_id} ended", file=sys.stderr)
        return 1
    if read is None:
        print(f"erlay: job {run_id} has not published its tree yet", file=sys.stderr)
        return 1
    if not args.watch:
        _show(read, address, choice.name, args.json, clear=False)
        return 0
    try:
        while True:
            _show(read, address, choice.name, args.json, clear=sys.stdout.isatty())
            time.sleep(max(args.interval, 0.1))
            try:
                read = read_endpoint(choice.name) or read
            except EndpointGone:
                print(f"erlay: job {run_id} ended")
                return 0
    except KeyboardInterrupt:
        return 0


def _show(read: dict[str, Any], address: str, name: str, as_json: bool, *,
          clear: bool) -> None:
    view = status_view(read, address=address, endpoint=name)
    if as_json:  # under --watch: one object per line
        print(render_json(view), flush=True)
        return
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    text = render_text(view, width)
    print(f"{CLEAR}{text}" if clear else text, flush=True)

"""Which processes a chaos run started, and which of them outlived it.

The orphan check must count the job's processes and nothing else: other work on the machine
(another test run, a compile, an editor) is never the job's.  :class:`ProcessWatch` samples,
while the run lasts, every descendant of this process: Ray's processes, the actors, the
sandbox runs, vLLM's engine cores.  It remembers each one (by pid and start time, so a
reused pid is not confused with it) and the sessions and process groups they created.  A
process the job started but that escaped the tree (a double fork, a ``setsid`` daemon) is
reparented away, but it stays in a session or group the job created, so it is still found.

After the run, :meth:`ProcessWatch.orphans` waits a grace period for the job's processes to
go, then lists those that remain.  This process's own session and group are never used to
claim processes: the test runner shares them with unrelated work.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psutil

GRACE_S = 15.0
SAMPLE_S = 0.5


class ProcessWatch:
    """Samples this process's descendants until :meth:`orphans` is called."""

    def __init__(self, sample_s: float = SAMPLE_S) -> None:
        self.sample_s = sample_s
        self.me = psutil.Process()
        self.own_groups = {os.getsid(0), os.getpgid(0)}
        self.seen: dict[int, float] = {}       # pid -> create_time
        self.before: dict[int, float] = {}     # descendants that predate the run
        self.sessions: set[int] = set()
        self.groups: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-process-watch",
                                        daemon=True)

    def start(self) -> ProcessWatch:
        """Start sampling; processes already descending from this one (a Ray a test
        fixture started, say) predate the run and are never its orphans."""
        for proc in self.me.children(recursive=True):
            try:
                self.before[proc.pid] = proc.create_time()
            except psutil.Error:
                continue
        self.sample()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.sample_s):
            self.sample()

    def sample(self) -> None:
        """Record every current descendant, its session and its process group."""
        try:
            descendants = self.me.children(recursive=True)
        except psutil.Error:
            return
        for proc in descendants:
            try:
                created = proc.create_time()
                if self.before.get(proc.pid) == created:
                    continue
                self.seen.setdefault(proc.pid, created)
                for gid in (os.getsid(proc.pid), os.getpgid(proc.pid)):
                    if gid not in self.own_groups:
                        (self.sessions if gid == os.getsid(proc.pid) else self.groups).add(gid)
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue

    def is_jobs(self, proc: psutil.Process) -> bool:
        """Started by the run: seen as a descendant (same start time), or living in a
        session or process group that one of those created."""
        try:
            if self.seen.get(proc.pid) == proc.create_time():
                return True
            return os.getsid(proc.pid) in self.sessions or os.getpgid(proc.pid) in self.groups
        except (psutil.Error, ProcessLookupError, PermissionError):
            return False

    def orphans(self, grace_s: float = GRACE_S) -> list[dict[str, Any]]:
        """The run's processes still alive after ``grace_s`` (zombies excluded)."""
        self.sample()
        self._stop.set()
        deadline = time.monotonic() + grace_s
        while True:
            left = self._left()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def _left(self) -> list[dict[str, Any]]:
        left = []
        for proc in psutil.process_iter(["pid", "cmdline", "uids", "status"]):
            if proc.pid == self.me.pid or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if not self.is_jobs(proc):
                continue
            left.append({"pid": proc.pid, "cmdline": " ".join(proc.info["cmdline"] or [])[:200],
                         "uid": proc.info["uids"].real if proc.info["uids"] else None})
        return left

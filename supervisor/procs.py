"""Process groups owned by a hosting process, so nothing a child spawns outlives it.

Every subprocess starts in its own session and process group and carries the keeper's token
in ``ERLAY_HOST_TOKEN``.  Stopping a child kills its whole group.  A reaper process (see
:mod:`supervisor.reaper`) watches the hosting process through a pipe and kills the registered
groups, and any stray process with the token, if the host dies without cleaning up.

Environment propagation: the keeper's declared ``env`` is added to every subprocess's
environment, and therefore reaches the processes those spawn too.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from supervisor.reaper import TOKEN_VAR, processes_with_token, same_group, start_ticks

log = logging.getLogger("erlay.supervisor")


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False if the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("no permission to signal process group %d", pgid)
        return False


class ProcessKeeper:
    """Spawns subprocesses for one hosting process and guarantees their cleanup."""

    def __init__(self, env: Mapping[str, str] | None = None, token: str | None = None) -> None:
        self.token = token or uuid.uuid4().hex
        self.declared_env = dict(env or {})
        self.groups: dict[int, int | None] = {}   # pgid -> its leader's start ticks
        self._reaper: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def child_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for a spawned process: ours, the declared set, then ``extra``."""
        env = dict(os.environ)
        env.update(self.declared_env)
        env.update(extra or {})
        env[TOKEN_VAR] = self.token
        return env

    def spawn(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | None = None, pass_fds: Sequence[int] = (),
              stdout: int | IO[Any] | None = subprocess.DEVNULL,
              stderr: int | IO[Any] | None = subprocess.STDOUT,
              stdin: int | IO[Any] | None = subprocess.DEVNULL,
              preexec_fn: Any = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` in a new session; its pid is its process group id."""
        self._ensure_reaper()
        proc = subprocess.Popen(list(argv), env=self.child_env(env), cwd=cwd,
                                pass_fds=tuple(pass_fds), stdout=stdout, stderr=stderr,
                                stdin=stdin, start_new_session=True, close_fds=True,
                                preexec_fn=preexec_fn)
        self._register(proc.pid)
        return proc

    def signal_group(self, pgid: int, sig: int) -> bool:
        """Send ``sig`` to a group this keeper spawned, unless its id has since been reused
        by someone else's group (pids wrap); False if it is gone or not ours any more."""
        with self._lock:
            leader_start = self.groups.get(pgid)
        if not same_group(pgid, leader_start):
            log.warning("process group %d was reused by another process; not signalling it",
                        pgid)
            return False
        return signal_group(pgid, sig)

    def kill_group(self, pgid: int) -> None:
        """SIGKILL a group and stop tracking it."""
        self.signal_group(pgid, signal.SIGKILL)
        self._unregister(pgid)

    def kill_all(self) -> None:
        """Kill every group this keeper spawned and every stray process with its token."""
        for pgid in list(self.groups):
            self.kill_group(pgid)
        for pid in processes_with_token(self.token):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def close(self) -> None:
        """Kill everything, then let the reaper exit."""
        self.kill_all()
        with self._lock:
            reaper, self._reaper = self._reaper, None
        if reaper is not None and reaper.stdin is not None:
            try:
                reaper.stdin.close()
                reaper.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                reaper.kill()

    # -- the reaper --------------------------------------------------------------------
    def _ensure_reaper(self) -> None:
        with self._lock:
            if self._reaper is not None and self._reaper.poll() is None:
                return
            script = str(Path(__file__).with_name("reaper.py"))
            env = {k: v for k, v in os.environ.items() if k != TOKEN_VAR}
            self._reaper = subprocess.Popen([sys.executable, "-I", "-S", script, self.token],
                                            stdin=subprocess.PIPE, env=env,
                                            start_new_session=True, close_fds=True)
            for pgid, leader_start in self.groups.items():
                self._tell(f"+{pgid}:{leader_start if leader_start is not None else ''}")

    def _tell(self, line: str) -> None:
        reaper = self._reaper
        if reaper is None or reaper.stdin is None:
            return
        try:
            reaper.stdin.write(f"{line}\n".encode())
            reaper.stdin.flush()
        except OSError:
            log.warning("the reaper is gone; subprocess cleanup relies on the host alone")

    def _register(self, pgid: int) -> None:
        leader_start = start_ticks(pgid)
        with self._lock:
            self.groups[pgid] = leader_start
            self._tell(f"+{pgid}:{leader_start if leader_start is not None else ''}")

    def _unregister(self, pgid: int) -> None:
        with self._lock:
            if pgid in self.groups:
                del self.groups[pgid]
                self._tell(f"-{pgid}")


_KEEPER: ProcessKeeper | None = None
_KEEPER_LOCK = threading.Lock()


def process_keeper() -> ProcessKeeper:
    """The keeper of this process.  A host and every child it hosts spawn through it, so
    one reaper covers them all."""
    global _KEEPER
    with _KEEPER_LOCK:
        if _KEEPER is None:
            _KEEPER = ProcessKeeper()
        return _KEEPER

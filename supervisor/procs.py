"""Process groups owned by a hosting process, so nothing a child spawns outlives it.

Every subprocess starts in its own session and process group and carries the keeper's token
in ``ERLAY_HOST_TOKEN``.  Stopping a child kills its whole group.  A reaper process (see
:mod:`erlay.supervisor.reaper`) watches the hosting process through a pipe and kills the registered
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

from erlay.supervisor.reaper import TOKEN_VAR, processes_with_token, same_group, start_ticks

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


class OwnGroup:
    """Makes the calling process the leader of its own process group, for a child whose
    library spawns processes erlay does not start itself (vLLM's EngineCore and workers).

    Those processes inherit the group and, through ``os.environ``, the keeper's token, so:

    - :meth:`kill_members` kills every other process of the group (a polite stop);
    - if this process dies, even by SIGKILL, the keeper's reaper kills the whole group and
      every process that carries the token (one that left the group included).

    Contract: call :meth:`adopt` before the library spawns anything.  The caller must not be
    a session leader (a Ray worker is not).
    """

    def __init__(self, keeper: ProcessKeeper | None = None) -> None:
        self.keeper = keeper or process_keeper()
        self.pgid: int | None = None

    def adopt(self) -> int:
        """Lead a new process group, register it with the reaper, export the token and the
        declared environment into ``os.environ``; returns the group id."""
        if os.getpgid(0) != os.getpid():
            os.setpgid(0, 0)
        self.pgid = os.getpid()
        # Spawned through multiprocessing, not the keeper: the environment they inherit is
        # ours, so the declared variables and the token must be in it.
        os.environ.update(self.keeper.declared_env)
        os.environ[TOKEN_VAR] = self.keeper.token
        self.keeper._ensure_reaper()
        self.keeper._register(self.pgid)
        return self.pgid

    def members(self) -> list[int]:
        """Other live processes of the group, or carrying the token (zombies excluded)."""
        import psutil

        me = os.getpid()
        found = set(processes_with_token(self.keeper.token))
        if self.pgid is not None:
            for proc in psutil.process_iter(["pid"]):
                try:
                    if proc.pid != me and os.getpgid(proc.pid) == self.pgid:
                        found.add(proc.pid)
                except (ProcessLookupError, psutil.Error):
                    continue
        alive = []
        for pid in sorted(found - {me}):
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                continue
        return alive

    def kill_members(self) -> list[int]:
        """SIGKILL every other member (see :meth:`members`); returns the pids signalled."""
        pids = self.members()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return pids

"""Subprocess children: a process in its own session and process group, owned by a
:class:`~erlay.supervisor.procs.ProcessKeeper`.

Exit is noticed through a pidfd registered with the event loop (no thread per child, no
polling).  When the child's main process ends, its whole group is killed, so nothing it
spawned survives it.  A polite stop sends SIGTERM to the group and SIGKILL after the
shutdown timeout.

Its heartbeat (``ChildSpec.liveness``) is its run state: a stopped process (SIGSTOP) does not
answer, and is killed with its group once the liveness deadline passes.

With ``wait_ready`` the child counts as started only once it writes a line to the file
descriptor in ``ERLAY_READY_FD``; exiting or staying silent past ``ready_timeout_s`` is a
start failure that names the exit code.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from typing import IO, Any

import psutil

from erlay.supervisor.errors import ChildStartError
from erlay.supervisor.procs import ProcessKeeper
from erlay.supervisor.progress import ProgressSnapshot
from erlay.supervisor.reason import KILLED, NORMAL, SHUTDOWN, ExitKind, ExitReason
from erlay.supervisor.runtime import ChildProcess, StartContext
from erlay.supervisor.spec import Shutdown, ShutdownKind, SubprocessStart


def exit_reason(returncode: int) -> ExitReason:
    """0 is normal; a signal or a non-zero code is abnormal, and says which."""
    if returncode == 0:
        return NORMAL
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        if -returncode == signal.SIGKILL:
            return ExitReason(ExitKind.KILLED, sig)
        return ExitReason(ExitKind.ERROR, f"killed by {sig}")
    return ExitReason(ExitKind.ERROR, f"exit code {returncode}")


class SubprocessChild:
    """One incarnation of a subprocess child."""

    def __init__(self, popen: subprocess.Popen[bytes], path: str, keeper: ProcessKeeper,
                 log_file: IO[bytes] | None) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.path = path
        self.keeper = keeper
        self.info: dict[str, Any] = {"kind": "subprocess", "pid": popen.pid}
        self._log_file = log_file
        self._forced: ExitReason | None = None
        loop = asyncio.get_running_loop()
        self._exit: asyncio.Future[ExitReason] = loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        loop.add_reader(self._pidfd, self._reap)

    @classmethod
    async def start(cls, ctx: StartContext, keeper: ProcessKeeper) -> ChildProcess:
        spec = ctx.spec.start
        assert isinstance(spec, SubprocessStart)
        env = {**spec.env, "ERLAY_CHILD_PATH": ctx.path, "ERLAY_INCARNATION": str(ctx.incarnation)}
        ready_r = ready_w = -1
        if spec.wait_ready:
            ready_r, ready_w = os.pipe()
            env["ERLAY_READY_FD"] = str(ready_w)
        log_file = open(spec.log_path, "ab") if spec.log_path else None  # noqa: SIM115
        try:
            popen = keeper.spawn(spec.argv, env=env, cwd=spec.cwd,
                                 pass_fds=(ready_w,) if spec.wait_ready else (),
                                 stdout=log_file or subprocess.DEVNULL, stderr=subprocess.STDOUT)
        except OSError as exc:
            raise ChildStartError(ctx.path, f"cannot spawn {spec.argv[0]}: {exc}") from None
        finally:
            if ready_w >= 0:
                os.close(ready_w)
        child = cls(popen, ctx.path, keeper, log_file)
        if spec.wait_ready:
            try:
                await child._await_ready(ready_r, spec.ready_timeout_s)
            finally:
                os.close(ready_r)
        return child

    async def _await_ready(self, fd: int, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[bytes] = loop.create_future()

        def readable() -> None:
            loop.remove_reader(fd)
            if not ready.done():
                ready.set_result(os.read(fd, 4096))

        loop.add_reader(fd, readable)
        try:
            done, _ = await asyncio.wait({ready, self._exit}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:   # a cancelled start leaves nothing running
            self.keeper.kill_group(self.pid)
            raise
        finally:
            loop.remove_reader(fd)
        if ready in done and ready.result():
            return
        if self._exit.done():
            raise ChildStartError(self.path, f"exited before ready ({self._exit.result()})")
        self.keeper.kill_group(self.pid)
        raise ChildStartError(self.path, f"not ready within {timeout_s:g} s")

    def _reap(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        try:
            _, status = os.waitpid(self.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            code = self.popen.poll() or 0
        self.popen.returncode = code
        # The main process is gone; whatever it spawned goes with it.
        self.keeper.kill_group(self.pid)
        if self._log_file is not None:
            self._log_file.close()
        if not self._exit.done():
            self._exit.set_result(self._forced or exit_reason(code))

    async def wait(self) -> ExitReason:
        return await asyncio.shield(self._exit)

    async def stop(self, shutdown: Shutdown) -> ExitReason:
        if self._exit.done():
            return self._exit.result()
        if shutdown.kind is ShutdownKind.BRUTAL_KILL:
            self._forced = KILLED
            self.keeper.kill_group(self.pid)
            return await asyncio.shield(self._exit)
        self.keeper_signal(signal.SIGTERM)
        timeout = None if shutdown.kind is ShutdownKind.INFINITY else shutdown.timeout_s
        try:
            reason = await asyncio.wait_for(asyncio.shield(self._exit), timeout)
        except TimeoutError:
            self._forced = ExitReason(ExitKind.KILLED, "did not stop within its shutdown timeout")
            self.keeper.kill_group(self.pid)
            return await asyncio.shield(self._exit)
        # Dying of SIGTERM, or exiting 0 after it, is how a process honours a shutdown.
        if reason.kind is ExitKind.NORMAL or reason.detail == "killed by SIGTERM":
            return SHUTDOWN
        return reason

    def keeper_signal(self, sig: int) -> None:
        self.keeper.signal_group(self.pid, sig)

    async def kill(self, reason: ExitReason) -> None:
        self._forced = reason
        self.keeper.kill_group(self.pid)

    async def progress(self, timeout_s: float) -> ProgressSnapshot | None:
        """The heartbeat of a process that speaks no protocol: its run state.  A stopped
        process (SIGSTOP, a tracer) does not answer, so the liveness deadline finds it."""
        try:
            status = psutil.Process(self.pid).status()
        except psutil.NoSuchProcess:
            return None  # it is exiting: the pidfd reports that
        if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            await asyncio.sleep(timeout_s)
            raise TimeoutError(f"{self.path} is stopped ({status})")
        return None

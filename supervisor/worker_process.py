"""Worker processes: hosted children that run code which may freeze, one call at a time, each
call under a deadline, in a subprocess of their own.

A node host (:mod:`erlay.supervisor.host`) keeps user code (environments, judges) out of
every supervising process by running it here.  The object is built inside the subprocess
(:mod:`erlay.supervisor.worker_main`) from :class:`~erlay.supervisor.spec.WorkerStart`;
:meth:`WorkerProcess.call` sends it one call and waits at most the call's deadline.

What a call can end in (:class:`CallOutcome`), and what it costs:

- ``ok``: the method's value.
- ``timeout``: no answer within the deadline.  Whatever the call does (a C call holding the
  GIL, a deadlock, a blocking read), the worker's process group is killed and a new process
  takes its place.  The call was the only one in the process, so the timeout is the call's.
- ``died``: the process died under the call (a segfault, ``os._exit``, the OOM killer); it is
  replaced.  A caller that sees one input die twice should call it poison and stop.
- ``lost``: the worker failed for a reason that is not the call's: it was stopped (SIGSTOP)
  when the deadline passed, or the served object itself raised (erlay's own code: a crash).
  The child then *exits* (``hang`` / ``error``), and its supervisor restarts it as any child.

Deviation from OTP, deliberate: a ``timeout`` or ``died`` replaces the process *in place*,
without an exit of the child, so it counts toward no restart intensity.  OTP would run such a
call in a temporary process, whose exit is never restarted and never counted: the failure
belongs to the input, not to the worker, and a user's plug-in that hangs on one input in a
hundred must cost those inputs, never the job.  A replacement that cannot start (spawn error,
constructor raising, not ready in time) is an exit of the child, counted as usual.

Liveness: an idle worker's heartbeat is its run state (a stopped process does not answer);
a busy worker is watched by its call's deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import pickle
import signal
import socket
import struct
import sys
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import psutil

from erlay.supervisor import failpoints
from erlay.supervisor.errors import ChildStartError
from erlay.supervisor.events import EventKind
from erlay.supervisor.procs import ProcessKeeper
from erlay.supervisor.progress import ProgressSnapshot
from erlay.supervisor.reason import KILLED, SHUTDOWN, ExitKind, ExitReason
from erlay.supervisor.runtime import StartContext
from erlay.supervisor.spec import Shutdown, ShutdownKind, WorkerStart
from erlay.supervisor.subprocess_child import exit_reason
from erlay.supervisor.worker_main import FD_VAR

log = logging.getLogger("erlay.supervisor")

_HEADER = struct.Struct(">I")
OutcomeKind = Literal["ok", "timeout", "died", "lost"]
# Failpoints armed for the worker processes of this host (a chaos run arms them through the
# host): a process started later, a replacement included, is armed at its start.
ARMED: dict[str, dict[str, Any]] = {}


@dataclass(frozen=True)
class CallOutcome:
    """How one call into a worker process ended (see the module docstring).

    ``value`` is the method's return value for ``ok``; ``detail`` says what happened
    otherwise; ``worker`` names the child path that ran (or was to run) it."""

    kind: OutcomeKind
    value: Any = None
    detail: str = ""
    worker: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


@dataclass(frozen=True)
class WorkerCall:
    """One call for a host's worker processes: ``method(*args, **kwargs)`` under
    ``timeout_s`` (None: the worker's ``call_timeout_s``).  ``label`` names the call in
    events, logs and ``erlay status`` (default: ``method``)."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    label: str = ""


class _Proc:
    """One process of a worker: its Popen, its socket and the reader of its replies."""

    def __init__(self, popen: Any, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.popen = popen
        self.pid: int = popen.pid
        self.reader = reader
        self.writer = writer
        self.exited: asyncio.Future[ExitReason] = asyncio.get_running_loop().create_future()

    async def send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer.write(_HEADER.pack(len(data)) + data)
        await self.writer.drain()

    async def recv(self) -> tuple[Any, ...]:
        header = await self.reader.readexactly(_HEADER.size)
        body = await self.reader.readexactly(_HEADER.unpack(header)[0])
        return pickle.loads(body)  # type: ignore[no-any-return]

    def stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP, a tracer): not the call's doing."""
        try:
            return psutil.Process(self.pid).status() in (psutil.STATUS_STOPPED,
                                                         psutil.STATUS_TRACING_STOP)
        except psutil.NoSuchProcess:
            return False


class WorkerProcess:
    """One worker child of a host (see the module docstring).  ``busy`` is True while a
    call runs or is reserved for it; the host's dispatcher reads it."""

    def __init__(self, ctx: StartContext, keeper: ProcessKeeper) -> None:
        spec = ctx.spec.start
        assert isinstance(spec, WorkerStart)
        self.spec = spec
        self.ctx = ctx
        self.path = ctx.path
        self.keeper = keeper
        self.info: dict[str, Any] = {"kind": "subprocess", "pid": None}
        self.busy = False
        self.calls = 0
        self.replaced = 0
        self.outcomes: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._proc: _Proc | None = None
        self._stopping = False
        self._replacing: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()   # one message in flight: a call or a control
        self._counter = 0
        self._working: str | None = None
        self._exit: asyncio.Future[ExitReason] = asyncio.get_running_loop().create_future()

    @classmethod
    async def start(cls, ctx: StartContext, keeper: ProcessKeeper) -> WorkerProcess:
        worker = cls(ctx, keeper)
        await worker._spawn()
        return worker

    # ---------------------------------------------------------------- the process
    async def _spawn(self) -> None:
        """Start a process, build the object in it, wait until it is ready.  Raises
        ChildStartError (nothing left running) when it cannot."""
        spec = self.spec
        host_end, child_end = socket.socketpair()
        env = {**spec.env, FD_VAR: str(child_end.fileno()), "ERLAY_CHILD_PATH": self.path}
        if ARMED:
            env[failpoints.ENV_VAR] = failpoints.env_value(
                {name: _own_seed(spec, f"{self.path}#{self.replaced}")
                 for name, spec in ARMED.items()})
        try:
            popen = self.keeper.spawn([sys.executable, "-m", "erlay.supervisor.worker_main"],
                                      env=env, pass_fds=(child_end.fileno(),),
                                      stdout=None, stderr=None)
        except OSError as exc:
            host_end.close()
            raise ChildStartError(self.path, f"cannot spawn a worker process: {exc}") from None
        finally:
            child_end.close()
        reader, writer = await asyncio.open_unix_connection(sock=host_end)
        proc = _Proc(popen, reader, writer)
        pidfd = os.pidfd_open(proc.pid)
        loop = asyncio.get_running_loop()
        loop.add_reader(pidfd, self._reap, proc, pidfd)
        try:
            await proc.send(("init", spec.factory, tuple(spec.args), dict(spec.kwargs)))
            reply = await asyncio.wait_for(self._recv_or_exit(proc), spec.ready_timeout_s)
        except TimeoutError:
            self._kill(proc)
            raise ChildStartError(self.path, f"not ready within {spec.ready_timeout_s:g} s "
                                  "(its constructor is still running)") from None
        except (ProcessExited, ConnectionError, asyncio.IncompleteReadError) as exc:
            self._kill(proc)
            raise ChildStartError(self.path, f"exited before ready ({exc})") from None
        except asyncio.CancelledError:
            self._kill(proc)
            raise
        if reply[0] != "ready":
            self._kill(proc)
            raise ChildStartError(self.path, f"{spec.factory} raised {reply[1]}")
        self._proc = proc
        self.info = {"kind": "subprocess", "pid": proc.pid, "class": reply[1].get("class")}

    async def _recv_or_exit(self, proc: _Proc) -> tuple[Any, ...]:
        """The next message, or ProcessExited if the process ends first."""
        receive = asyncio.ensure_future(proc.recv())
        try:
            done, _ = await asyncio.wait({receive, proc.exited},
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not receive.done():
                receive.cancel()
        if receive in done:
            return receive.result()
        raise ProcessExited(str(proc.exited.result()))

    def _reap(self, proc: _Proc, pidfd: int) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(pidfd)
        os.close(pidfd)
        try:
            _, status = os.waitpid(proc.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            code = proc.popen.poll() or 0
        proc.popen.returncode = code
        self.keeper.kill_group(proc.pid)  # what it spawned goes with it
        proc.writer.close()
        if not proc.exited.done():
            proc.exited.set_result(exit_reason(code))
        if proc is self._proc and not self.busy and not self._stopping \
                and not self._exit.done():
            # Death while idle is the worker's own failure: its supervisor decides.
            self._exit.set_result(exit_reason(code))

    def _kill(self, proc: _Proc) -> None:
        self.keeper.kill_group(proc.pid)

    async def _replace(self, proc: _Proc, why: str) -> None:
        """Kill ``proc`` (if it still runs) and start another in its place; a replacement
        that cannot start ends the child."""
        self._kill(proc)
        await asyncio.shield(proc.exited)
        if self._stopping:
            return
        self.replaced += 1
        self.ctx.notify(EventKind.REPLACED, why)
        try:
            await self._spawn()
        except ChildStartError as exc:
            self._proc = None
            if not self._exit.done():
                self._exit.set_result(ExitReason(ExitKind.ERROR, f"replacement failed: {exc}"))

    async def _replace_then_free(self, proc: _Proc) -> None:
        try:
            await self._replace(proc, "its caller gave up on a call")
        finally:
            self.busy = False

    # ---------------------------------------------------------------- calls
    async def call(self, method: str, args: tuple[Any, ...] = (),
                   kwargs: dict[str, Any] | None = None, *,
                   timeout_s: float | None = None, label: str = "") -> CallOutcome:
        """Run ``method`` in the worker process; see :class:`CallOutcome`.  One call at a
        time: a second caller waits (the host's dispatcher avoids that by reading
        ``busy``).  Never raises for anything the worker does."""
        timeout = self.spec.call_timeout_s if timeout_s is None else timeout_s
        self.busy = True
        try:
            async with self._lock:   # a failpoint control message may hold the process
                outcome = await self._call(method, args, kwargs or {}, timeout,
                                           label or method)
        except asyncio.CancelledError:
            # The caller gave up (its own deadline, a shutdown).  If the call was sent, the
            # process may be mid-call and its late reply would answer the next call: kill
            # it; a replacement starts in the background and frees the worker when it is up.
            proc = self._proc
            if self._working is not None and proc is not None and not self._stopping:
                self._kill(proc)
                self._replacing = asyncio.ensure_future(self._replace_then_free(proc))
                self._working = None
                raise
            self.busy = False
            raise
        finally:
            self._working = None
            self._counter += 1
        self.busy = False
        self.calls += 1
        self.outcomes[outcome.kind] = self.outcomes.get(outcome.kind, 0) + 1
        return outcome

    async def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                    timeout: float, label: str) -> CallOutcome:
        proc = self._proc
        if proc is None or self._exit.done() or proc.exited.done():
            return CallOutcome("lost", detail=f"{self.path} is not running", worker=self.path)
        call_id = next(self._ids)
        self._working = label
        self._counter += 1
        try:
            await proc.send(("call", call_id, method, args, kwargs))
            reply = await asyncio.wait_for(self._recv_or_exit(proc), timeout)
        except TimeoutError:
            if proc.stopped():
                # Frozen from outside, not by the call: the worker hangs, its supervisor
                # restarts it, and the call may be tried elsewhere.
                self._kill(proc)
                self._end(ExitReason(ExitKind.HANG, "its process was stopped (SIGSTOP)"))
                return CallOutcome("lost", detail=f"{self.path} was stopped under the call",
                                   worker=self.path)
            await self._replace(proc, f"{label} gave no answer within {timeout:g} s")
            return CallOutcome("timeout", detail=f"no answer within {timeout:g} s",
                               worker=self.path)
        except (ProcessExited, ConnectionError, asyncio.IncompleteReadError):
            reason = await asyncio.shield(proc.exited)
            await self._replace(proc, f"it died under {label} ({reason})")
            return CallOutcome("died", detail=f"the worker process died under the call "
                               f"({reason})", worker=self.path)
        if reply[0] != "reply" or reply[1] != call_id:
            self._kill(proc)
            self._end(ExitReason(ExitKind.ERROR, f"protocol error: {reply[:2]!r}"))
            return CallOutcome("lost", detail="protocol error", worker=self.path)
        if reply[2] == "raised":
            # The served object is erlay's code: what escapes it is a crash of the worker.
            self._kill(proc)
            self._end(ExitReason(ExitKind.ERROR, f"{method} raised {reply[3]}"))
            log.error("%s crashed in %s:\n%s", self.path, method, reply[4])
            return CallOutcome("lost", detail=f"the worker crashed: {reply[3]}",
                               worker=self.path)
        return CallOutcome("ok", reply[3], worker=self.path)

    async def control(self, op: str, name: str | None = None,
                      spec: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Apply a failpoint operation inside the worker process (chaos), once the call it
        runs (if any) has ended; None when it is not running, or not free within its call
        deadline and ten seconds (a later process gets :data:`ARMED` at its start)."""
        try:
            async with asyncio.timeout(self.spec.call_timeout_s + 10.0), self._lock:
                if self._replacing is not None:
                    await asyncio.shield(self._replacing)
                proc = self._proc
                if proc is None or proc.exited.done() or self._exit.done():
                    return None
                await proc.send(("failpoints", op, name, spec))
                try:
                    reply = await asyncio.wait_for(self._recv_or_exit(proc), 5.0)
                except TimeoutError:
                    # Its late answer would be read as the next call's: end it.
                    self._kill(proc)
                    self._end(ExitReason(ExitKind.HANG, "no answer to a control message"))
                    return None
                return reply[1] if reply[0] == "control" else None
        except (TimeoutError, ProcessExited, ConnectionError, asyncio.IncompleteReadError):
            return None

    def _end(self, reason: ExitReason) -> None:
        if not self._exit.done():
            self._exit.set_result(reason)

    # ---------------------------------------------------------------- ChildProcess
    @property
    def alive(self) -> bool:
        """Whether the child still runs (its process may be being replaced)."""
        return not self._exit.done()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def wait(self) -> ExitReason:
        return await asyncio.shield(self._exit)

    async def stop(self, shutdown: Shutdown) -> ExitReason:
        proc = self._proc
        if self._exit.done() or proc is None:
            return self._exit.result() if self._exit.done() else SHUTDOWN
        if shutdown.kind is ShutdownKind.BRUTAL_KILL:
            self._kill(proc)
            self._end(KILLED)
            return KILLED
        self._stopping = True
        if self._replacing is not None:
            self._replacing.cancel()
        # Closing the socket ends an idle worker; SIGTERM one that is busy.
        proc.writer.close()
        self.keeper.signal_group(proc.pid, signal.SIGTERM)
        timeout = None if shutdown.kind is ShutdownKind.INFINITY else shutdown.timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(proc.exited), timeout)
            reason = SHUTDOWN
        except TimeoutError:
            self._kill(proc)
            reason = ExitReason(ExitKind.KILLED, "did not stop within its shutdown timeout")
        self._end(reason)
        return reason

    async def kill(self, reason: ExitReason) -> None:
        self._stopping = True
        if self._replacing is not None:
            self._replacing.cancel()
        if self._proc is not None:
            self._kill(self._proc)
        self._end(reason)

    async def progress(self, timeout_s: float) -> ProgressSnapshot | None:
        """Progress for ``erlay status`` (phase ``worker_call`` while a call runs); the
        heartbeat of an idle process is its run state, so a stopped one does not answer."""
        proc = self._proc
        if proc is not None and not self.busy and proc.stopped():
            await asyncio.sleep(timeout_s)
            raise TimeoutError(f"{self.path} is stopped")
        return ProgressSnapshot(self._counter, "worker_call" if self._working else None,
                                self._working)

    def stats(self) -> dict[str, Any]:
        """Counters: calls, outcomes by kind, processes replaced, the current pid."""
        return {"calls": self.calls, "outcomes": dict(self.outcomes),
                "replaced": self.replaced, "pid": self.pid}


def _own_seed(spec: dict[str, Any], process: str) -> dict[str, Any]:
    """``spec`` with a seed of this process's own, drawn from its seed and ``process``: a
    replacement that replayed its predecessor's draws would fail at the same call again, and
    a seeded share of failures would become one failure every few calls."""
    if spec.get("seed") is None:
        return spec
    digest = hashlib.blake2b(f"{spec['seed']}:{process}".encode(), digest_size=4).digest()
    return {**spec, "seed": int.from_bytes(digest, "big")}


class WorkerPool:
    """Hands the worker processes of one host to calls, first come first served.

    ``children`` lists the running workers (a restarted one appears there once it is up).  A
    worker is free when it is not ``busy``; a call that finds none waits in line, and a worker
    that finishes goes to the longest waiter, so a burst of calls costs one wake-up each."""

    RESCAN_S = 0.25   # how often a waiter looks for a worker that (re)started meanwhile

    def __init__(self, children: Callable[[], list[WorkerProcess]]) -> None:
        self._children = children
        self._waiters: deque[asyncio.Future[WorkerProcess]] = deque()

    async def run(self, call: WorkerCall, queue_timeout_s: float) -> CallOutcome:
        """``call`` on the first free worker; ``lost`` if none is free within
        ``queue_timeout_s``."""
        worker = await self._acquire(queue_timeout_s)
        if worker is None:
            return CallOutcome("lost", detail=f"no worker process was free within "
                               f"{queue_timeout_s:g} s")
        try:
            return await worker.call(call.method, call.args, dict(call.kwargs),
                                     timeout_s=call.timeout_s, label=call.label)
        finally:
            self._release(worker)

    def _take(self) -> WorkerProcess | None:
        for worker in self._children():
            if not worker.busy and worker.alive:
                worker.busy = True
                return worker
        return None

    async def _acquire(self, timeout_s: float) -> WorkerProcess | None:
        worker = self._take() if not self._waiters else None
        if worker is not None:
            return worker
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[WorkerProcess] = loop.create_future()
        self._waiters.append(waiter)
        give_up = loop.time() + timeout_s
        try:
            while True:
                left = give_up - loop.time()
                try:
                    return await asyncio.wait_for(asyncio.shield(waiter),
                                                  max(0.0, min(self.RESCAN_S, left)))
                except TimeoutError:
                    if waiter.done():
                        return waiter.result()
                    if self._waiters and self._waiters[0] is waiter:
                        worker = self._take()
                        if worker is not None:
                            return worker
                    if loop.time() >= give_up:
                        return None
        except BaseException:
            # Cancelled while in line: a worker handed over meanwhile goes to the next.
            if waiter.done() and not waiter.cancelled():
                handed = waiter.result()
                handed.busy = False
                self._release(handed)
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            if not waiter.done():
                waiter.cancel()

    def _release(self, worker: WorkerProcess) -> None:
        if worker.busy or not worker.alive:   # replacing its process, or gone
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                worker.busy = True
                waiter.set_result(worker)
                return


class ProcessExited(Exception):
    """The worker process ended while a reply was awaited."""

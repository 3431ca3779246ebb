"""The shell: one asyncio task per supervisor that feeds events to the decision core and
carries out its plans through child drivers.

A :class:`Supervisor` behaves like an OTP supervisor process.  Every state change happens in
its own main task, one event at a time, so the core's plan contract holds (see
:mod:`erlay.supervisor.core`).  Drivers ("starters") know how to start one kind of child and return
a :class:`ChildProcess`; the shell watches each incarnation with a pending ``wait()``, which
resolves when the incarnation ends, and polls every child with deadlines or a heartbeat
(``ChildSpec.liveness``, on by default) for its progress.

Invariant: no child outlives its supervisor.  When a supervisor terminates, for any reason
including a bug in the shell, it stops every child it started before its exit resolves.

Deviations from OTP:

- A shutdown cancels a restart in progress (a start after a crash, or through the dynamic
  API) whose starter is :func:`cancel_safe`, instead of waiting for it: an engine start takes
  tens of seconds, and a hung one lasts until its ready timeout.  The cancelled start is a
  start error ("start cancelled: ...") and counts toward no restart intensity, since the
  supervisor terminates next.  Boot starts, and unmarked starters, are waited for, as in OTP.

- Nested supervisors run as tasks in the same event loop as their parent rather than as
  separate processes.  A supervisor is cheap; only children need process isolation.
- Killing a nested supervisor (its parent's brutal_kill or a timeout) brutally stops its
  subtree first, so nothing is orphaned.
- Hang detection (progress deadlines, the liveness heartbeat) and quarantine are erlay
  additions; a hung child is killed and its exit reason is ``hang``, which is abnormal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from erlay.supervisor import core
from erlay.supervisor.clock import Clock, SystemClock
from erlay.supervisor.errors import ChildStartError, SupervisorCallError
from erlay.supervisor.events import EventKind, EventSink, LoggingSink, SupervisorEvent
from erlay.supervisor.health import Health, hang_verdict, observe, progress_age
from erlay.supervisor.naming import child_path
from erlay.supervisor.progress import ProgressSnapshot
from erlay.supervisor.reason import SHUTDOWN, ExitKind, ExitReason, from_exception
from erlay.supervisor.spec import (
    BRUTAL_KILL,
    ChildSpec,
    Shutdown,
    StartSpec,
    SupervisorFlags,
    SupervisorStart,
)

log = logging.getLogger("erlay.supervisor")

CANCELLED_START = "start cancelled: the supervisor is shutting down"


class ChildProcess(Protocol):
    """One running incarnation of a child, as its supervisor sees it."""

    info: dict[str, Any]

    async def wait(self) -> ExitReason:
        """Resolve when the incarnation ends by itself (or after :meth:`kill`)."""
        ...

    async def stop(self, shutdown: Shutdown) -> ExitReason:
        """Stop as the shutdown policy says; return how it ended.  Never leaves it running."""
        ...

    async def kill(self, reason: ExitReason) -> None:
        """Kill at once; a pending :meth:`wait` then resolves with ``reason``."""
        ...

    async def progress(self, timeout_s: float) -> ProgressSnapshot | None:
        """The child's progress counters; raise TimeoutError if it does not answer."""
        ...


@dataclass
class StartContext:
    spec: ChildSpec
    path: str
    incarnation: int
    args: tuple[Any, ...]
    supervisor: Supervisor

    def notify(self, kind: EventKind, reason: str) -> None:
        """Emit a child-level event (quarantine, recovery) under the child's supervisor."""
        self.supervisor.emit(kind, self.path.rsplit("/", 1)[1], reason, 0)


Starter = Callable[[StartContext], Awaitable[ChildProcess]]
S = TypeVar("S")


def cancel_safe(starter: S) -> S:
    """Mark ``starter`` as leaving nothing running when its start is cancelled.

    A supervisor asked to shut down cancels a *restart* in progress only when its starter is
    marked (see :meth:`Supervisor.shutdown`); an unmarked starter's start is waited for, as
    in OTP.  Returns ``starter``."""
    starter.erlay_cancel_safe = True  # type: ignore[attr-defined]
    return starter


class Supervisor:
    """An OTP supervisor running in the current event loop.

    ``starters`` maps a StartSpec type to the driver that starts it; nested supervisors are
    always supported.  Create, then ``await boot()``; a boot failure raises ChildStartError
    and leaves nothing running.
    """

    def __init__(self, path: str, flags: SupervisorFlags, specs: tuple[ChildSpec, ...] | list,
                 *, starters: dict[type[StartSpec], Starter], sink: EventSink | None = None,
                 clock: Clock | None = None) -> None:
        self.path = path
        self.state = core.init_state(path, flags, tuple(specs))
        self.starters = starters
        self.sink: EventSink = sink or LoggingSink()
        self.clock: Clock = clock or SystemClock()
        self._procs: dict[str, ChildProcess] = {}
        self._stopping: dict[str, ChildProcess] = {}   # being stopped right now
        self._watchers: dict[str, asyncio.Task[ExitReason]] = {}
        self._health: dict[str, Health] = {}
        self._killing: set[str] = set()
        self._incarnations: dict[str, int] = {}
        self._replies: dict[int, asyncio.Future[core.Reply]] = {}
        self._refs = itertools.count(1)
        self._brutal = False
        self._queue: asyncio.Queue[core.Event] = asyncio.Queue()
        self._deadlines_changed = asyncio.Event()
        self._exit: asyncio.Future[ExitReason] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._starting: asyncio.Task[ChildProcess] | None = None   # a cancellable start
        self._timers: set[asyncio.TimerHandle] = set()   # delayed restarts (ScheduleRestart)
        self._shutting_down = False

    # ------------------------------------------------------------------------ lifecycle
    async def boot(self) -> None:
        """Start the children in order.  Raises ChildStartError naming the one that failed."""
        self._exit = asyncio.get_running_loop().create_future()
        await self._apply(core.Boot())
        if self.state.phase is core.Phase.TERMINATED:
            reason = self.state.exit_reason or SHUTDOWN
            self._finish(reason)
            raise ChildStartError(reason.offender or self.path, reason.detail)
        self._tasks = [asyncio.create_task(self._run(), name=f"{self.path}:main"),
                       asyncio.create_task(self._watch_health(), name=f"{self.path}:health")]

    async def wait_exit(self) -> ExitReason:
        """Resolve with the supervisor's exit reason once it has terminated."""
        assert self._exit is not None, "boot() first"
        return await asyncio.shield(self._exit)

    @property
    def exited(self) -> bool:
        return self._exit is not None and self._exit.done()

    async def shutdown(self, reason: ExitReason = SHUTDOWN, *, brutal: bool = False) -> ExitReason:
        """Stop every child in reverse start order, then terminate.  Idempotent.

        A restart in progress whose starter is :func:`cancel_safe` is cancelled first, not
        waited for (the module's deviations from OTP)."""
        if self.exited:
            return self._exit.result()  # type: ignore[union-attr]
        self._brutal = self._brutal or brutal
        self._shutting_down = True
        if self._starting is not None and not self._starting.done():
            # Before the call below is queued, so no retry of this start can run first.
            self._starting.cancel()
        await self._call(lambda ref: core.ShutdownCall(ref, reason))
        return await self.wait_exit()

    # ----------------------------------------------------------------------- dynamic API
    async def start_child(self, spec: ChildSpec | None = None, args: tuple[Any, ...] = ()) -> str:
        """Add and start a child (a spec, or args for simple_one_for_one); return its id."""
        return await self._checked(lambda ref: core.StartChildCall(ref, spec, tuple(args)))

    async def terminate_child(self, child_id: str) -> None:
        await self._checked(lambda ref: core.TerminateChildCall(ref, child_id))

    async def restart_child(self, child_id: str) -> str:
        return await self._checked(lambda ref: core.RestartChildCall(ref, child_id))

    async def delete_child(self, child_id: str) -> None:
        await self._checked(lambda ref: core.DeleteChildCall(ref, child_id))

    def which_children(self) -> list[dict[str, Any]]:
        """One row per child, in start order, with what status displays need."""
        now = self.clock.monotonic()
        rows = []
        for info in core.which_children(self.state):
            proc = self._procs.get(info.id)
            health = self._health.get(info.id)
            rows.append({
                "id": info.id, "path": child_path(self.path, info.id),
                "status": info.status.value, "type": info.type.value,
                "incarnation": info.incarnation, "restarts": info.restarts,
                "last_exit": str(info.last_exit) if info.last_exit else None,
                "info": dict(proc.info) if proc is not None else {},
                "phase": health.phase if health else None,
                "work": health.work if health else None,
                "progress_age_s": round(progress_age(health, now), 3) if health else None,
                # Without deadlines nobody judges its progress: its age means nothing.
                "watched": bool(self.state.children[info.id].spec.deadlines),
                "heartbeat_age_s": round(now - health.last_answer, 3) if health else None,
            })
        return rows

    def count_children(self) -> dict[str, int]:
        return core.count_children(self.state)

    def child(self, child_id: str) -> ChildProcess | None:
        """The running incarnation of ``child_id``, or None."""
        return self._procs.get(child_id)

    def live_processes(self) -> list[ChildProcess]:
        """Every incarnation not known to be gone: running, or being stopped right now (a
        stop that a last-resort kill must still reach)."""
        return [*self._procs.values(), *self._stopping.values()]

    def children_ids(self) -> list[str]:
        return list(self.state.order)

    # ----------------------------------------------------------------------------- events
    def emit(self, kind: EventKind, child_id: str | None, reason: str, attempt: int,
             **extra: Any) -> None:
        rec = self.state.children.get(child_id) if child_id else None
        if rec is not None:
            extra.setdefault("incarnation", rec.incarnation)
        proc = self._procs.get(child_id) if child_id else None
        if proc is not None and "pid" in proc.info:
            extra.setdefault("pid", proc.info["pid"])
        self.sink.emit(SupervisorEvent(self.path, child_id, kind, reason, attempt,
                                       self.clock.wall(), extra))

    # --------------------------------------------------------------------------- internals
    async def _call(self, make: Callable[[int], core.Event]) -> core.Reply:
        if self.exited:
            return core.Reply(None, False, "terminated")
        ref = next(self._refs)
        fut: asyncio.Future[core.Reply] = asyncio.get_running_loop().create_future()
        self._replies[ref] = fut
        self._queue.put_nowait(make(ref))
        return await fut

    async def _checked(self, make: Callable[[int], core.Event]) -> Any:
        reply = await self._call(make)
        if not reply.ok:
            raise SupervisorCallError(str(reply.value), self.path)
        return reply.value

    async def _run(self) -> None:
        try:
            while self.state.phase is not core.Phase.TERMINATED:
                await self._apply(await self._queue.get())
        except asyncio.CancelledError:
            await self._emergency_stop(ExitReason(ExitKind.KILLED, "supervisor cancelled"))
            raise
        except Exception as exc:
            log.exception("supervisor %s crashed; stopping its children", self.path)
            await self._emergency_stop(from_exception(exc))
        finally:
            self._finish(self.state.exit_reason or SHUTDOWN)

    async def _apply(self, event: core.Event) -> None:
        if isinstance(event, core.ChildExited):
            self._forget(event.child_id, event.incarnation)
        decision = core.decide(self.state, event, self.clock.monotonic())
        self.state = decision.state
        await self._execute(decision.actions)

    def _feedback(self, event: core.Event, plan: deque[core.Action], *,
                  replace: bool) -> deque[core.Action]:
        decision = core.decide(self.state, event, self.clock.monotonic())
        self.state = decision.state
        return deque(decision.actions) if replace else deque(decision.actions) + plan

    async def _execute(self, actions: tuple[core.Action, ...]) -> None:
        plan: deque[core.Action] = deque(actions)
        while plan:
            action = plan.popleft()
            match action:
                case core.Start(cid, inc, ctx, ref):
                    try:
                        await self._start(cid, inc, cancellable=ctx is not core.Context.BOOT)
                    except Exception as exc:  # noqa: BLE001 - any start failure is a result
                        failed = core.StartFailed(cid, inc, _describe(exc), ctx, ref)
                        plan = self._feedback(failed, plan, replace=True)
                        continue
                    plan = self._feedback(core.Started(cid, inc, ctx, ref), plan, replace=False)
                case core.Stop(cid, inc, remove):
                    reason = await self._stop(cid)
                    plan = self._feedback(core.Stopped(cid, inc, reason, remove), plan,
                                          replace=False)
                case core.StopMany(children):
                    reasons = await asyncio.gather(*(self._stop(cid) for cid, _ in children))
                    for (cid, inc), reason in zip(children, reasons, strict=True):
                        plan = self._feedback(core.Stopped(cid, inc, reason), plan, replace=False)
                case core.Report(kind, cid, reason, attempt):
                    self.emit(kind, cid, reason, attempt)
                case core.Reply(ref):
                    fut = self._replies.pop(ref, None)
                    if fut is not None and not fut.done():
                        fut.set_result(action)
                case core.ScheduleTryAgain(cid):
                    self._queue.put_nowait(core.TryAgainRestart(cid))
                case core.ScheduleRestart(cid, delay_s, restart):
                    self._schedule(delay_s, core.RestartDue(cid, restart))
                case core.Terminate():
                    pass  # the main loop sees the TERMINATED phase and finishes

    async def _start(self, cid: str, inc: int, *, cancellable: bool = False) -> None:
        rec = self.state.children[cid]
        starter = self._starter_for(rec.spec.start)
        ctx = StartContext(rec.spec, child_path(self.path, cid), inc, rec.args, self)
        if cancellable and getattr(starter, "erlay_cancel_safe", False):
            proc = await self._cancellable_start(starter, ctx)
        else:
            proc = await starter(ctx)
        self._procs[cid] = proc
        self._incarnations[cid] = inc
        self._health[cid] = Health.new(self.clock.monotonic())
        self._watchers[cid] = asyncio.create_task(self._watch(cid, inc, proc),
                                                  name=f"{ctx.path}#{inc}:watch")
        if rec.spec.poll_interval_s is not None:
            self._deadlines_changed.set()

    async def _cancellable_start(self, starter: Starter, ctx: StartContext) -> ChildProcess:
        """Run one start that :meth:`shutdown` may cancel; its cancellation is a start error.

        Our own task's cancellation (the supervisor killed) still propagates as such."""
        task = asyncio.ensure_future(starter(ctx))
        self._starting = task
        if self._shutting_down:
            task.cancel()
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():   # we were cancelled, not the start: the supervisor is killed
                task.cancel()
                raise
            raise ChildStartError(ctx.path, CANCELLED_START) from None
        except Exception as exc:
            if task.cancelling():   # we cancelled it; its starter raised an error instead
                log.debug("%s: cancelled start ended with %s", ctx.path, _describe(exc))
                raise ChildStartError(ctx.path, CANCELLED_START) from None
            raise
        finally:
            self._starting = None

    def _starter_for(self, start: StartSpec) -> Starter:
        if isinstance(start, SupervisorStart):
            return start_nested_supervisor
        for kind, starter in self.starters.items():
            if isinstance(start, kind):
                return starter
        raise TypeError(f"{type(start).__name__} children cannot run under {self.path}")

    async def _watch(self, cid: str, inc: int, proc: ChildProcess) -> ExitReason:
        try:
            reason = await proc.wait()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failing watch is a dead child
            reason = from_exception(exc)
        self._queue.put_nowait(core.ChildExited(cid, inc, reason))
        return reason

    def _forget(self, cid: str, inc: int) -> None:
        """Drop a dead incarnation's process, watcher and health record."""
        if self._incarnations.get(cid) == inc:
            self._procs.pop(cid, None)
            self._watchers.pop(cid, None)
            self._health.pop(cid, None)
            self._killing.discard(cid)
            self._incarnations.pop(cid, None)

    async def _stop(self, cid: str) -> ExitReason:
        proc = self._procs.pop(cid, None)
        watcher = self._watchers.pop(cid, None)
        self._health.pop(cid, None)
        self._killing.discard(cid)
        self._incarnations.pop(cid, None)
        if proc is None:
            return SHUTDOWN
        if watcher is not None and watcher.done() and not watcher.cancelled():
            return watcher.result()  # it had already ended by itself
        if watcher is not None:
            watcher.cancel()
        policy = BRUTAL_KILL if self._brutal else self.state.children[cid].spec.shutdown_policy
        self._stopping[cid] = proc
        try:
            return await proc.stop(policy)
        except Exception as exc:
            log.exception("stopping %s failed", child_path(self.path, cid))
            return from_exception(exc)
        finally:
            self._stopping.pop(cid, None)

    async def _watch_health(self) -> None:
        while not self.exited:
            targets = [(cid, proc) for cid, proc in self._procs.items()
                       if self.state.children[cid].spec.poll_interval_s is not None
                       and cid not in self._killing]
            if not targets:
                self._deadlines_changed.clear()
                await self._deadlines_changed.wait()
                continue
            interval = min(self.state.children[c].spec.poll_interval_s  # type: ignore[type-var]
                           for c, _ in targets)
            # A check waits up to ``interval`` for its answer, concurrently with the next
            # period's sleep: a silent child is judged every ``interval``, not every two.
            await asyncio.gather(asyncio.sleep(interval),
                                 *(self._check(cid, proc, interval) for cid, proc in targets))

    async def _check(self, cid: str, proc: ChildProcess, timeout_s: float) -> None:
        try:
            snap = await proc.progress(timeout_s)
        except Exception:  # noqa: BLE001 - silence; the deadline decides, not the error
            snap = None
            answered = False
        else:
            answered = True
        if self._procs.get(cid) is not proc or cid in self._killing:
            return
        now = self.clock.monotonic()
        health = self._health[cid]
        if answered:
            health = self._health[cid] = observe(health, snap, now)
        spec = self.state.children[cid].spec
        verdict = hang_verdict(health, spec.deadlines, now,
                               spec.liveness.deadline_s if spec.liveness else None)
        if verdict is None:
            return
        self._killing.add(cid)
        rec = self.state.children[cid]
        self.emit(EventKind.HANG, cid, verdict, rec.restarts)
        await proc.kill(ExitReason(ExitKind.HANG, verdict))

    async def _emergency_stop(self, reason: ExitReason) -> None:
        self._brutal = True
        await asyncio.gather(*(self._stop(cid) for cid in list(self._procs)),
                             return_exceptions=True)
        self.state = dataclasses.replace(self.state, phase=core.Phase.TERMINATED,
                                         exit_reason=reason)

    def _schedule(self, delay_s: float, event: core.Event) -> None:
        """Queue ``event`` after ``delay_s``; the main task stays free meanwhile."""
        def due() -> None:
            self._timers.discard(handle)
            self._queue.put_nowait(event)

        handle = asyncio.get_running_loop().call_later(delay_s, due)
        self._timers.add(handle)

    def _finish(self, reason: ExitReason) -> None:
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
        try:
            current = asyncio.current_task()
        except RuntimeError:  # the loop is gone (process teardown)
            current = None
        for task in self._tasks:
            if task is not current:
                task.cancel()
        for fut in self._replies.values():
            if not fut.done():
                fut.set_result(core.Reply(None, False, "terminated"))
        self._replies.clear()
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(reason)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ChildStartError):
        return exc.reason
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


# ------------------------------------------------------------------ nested supervisors

class NestedSupervisor:
    """A child that is itself a supervisor in the same event loop."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.info: dict[str, Any] = {"kind": "supervisor"}

    async def wait(self) -> ExitReason:
        return await self.sup.wait_exit()

    async def stop(self, shutdown: Shutdown) -> ExitReason:
        if shutdown.kind.value == "brutal_kill":
            await self.sup.shutdown(brutal=True)
            return ExitReason(ExitKind.KILLED)
        try:
            return await asyncio.wait_for(asyncio.shield(self.sup.shutdown()),
                                          shutdown.timeout_s if shutdown.timeout_s
                                          != float("inf") else None)
        except TimeoutError:
            await self.sup.shutdown(brutal=True)
            return ExitReason(ExitKind.KILLED, "subtree did not stop within its timeout")

    async def kill(self, reason: ExitReason) -> None:
        await self.sup.shutdown(reason, brutal=True)

    async def progress(self, timeout_s: float) -> ProgressSnapshot | None:
        return None


async def start_nested_supervisor(ctx: StartContext) -> ChildProcess:
    start = ctx.spec.start
    assert isinstance(start, SupervisorStart)
    parent = ctx.supervisor
    sub = Supervisor(ctx.path, start.flags, start.children, starters=parent.starters,
                     sink=parent.sink, clock=parent.clock)
    await sub.boot()
    return NestedSupervisor(sub)

"""Actor children: one dedicated Ray actor per incarnation, restarted by the supervisor.

The user's class is subclassed with a few ``_erlay_*`` methods and made remote with Ray's
``max_restarts=0``: Ray never restarts it, the supervisor does.

- **Death** is noticed through a pending ``_erlay_monitor`` call, which fails with
  ``ActorDiedError`` a few milliseconds after the process dies.  Nothing polls for death.
  The ready answer (``info``) names the process (``pid``, ``node_id``) and its exit beacons
  (``exit_tids``, :func:`erlay.supervisor.pidwatch.exit_beacons`), so that a caller on the
  same node can see it die sooner still, through pidfds.
- **Hang**: ``_erlay_progress`` returns the child's :class:`~erlay.supervisor.progress.Progress`
  snapshot (attribute ``progress``); the supervisor applies the deadlines.
- **Unavailable** (``ActorUnavailableError``): the child is quarantined and probed until it
  answers, is confirmed dead, or stays unreachable past ``quarantine_timeout_s``.

Optional hooks on the user's class, sync or async to match the class:

- ``erlay_ready()``: runs before the child counts as started (load a model, boot a host);
  raising is a start failure.
- ``erlay_wait()``: return (an ExitReason dict) when the child ends by itself; hosts use it
  to report that their local supervisor gave up.
- ``erlay_terminate()``: graceful cleanup on a polite shutdown.  The process is always killed
  afterwards, so nothing it spawned outlives it unless it detached on purpose.

``_erlay_failpoints(op, name, spec)`` arms, disarms or lists the failpoints of the actor's
process (see :func:`erlay.supervisor.failpoints.control`).  For a node host that includes every
in-process child it hosts, since they share its process; a class with an async
``erlay_failpoints_changed(op, name, spec)`` hears of each change, and a host uses it to arm
its worker processes too.

A synchronous (threaded) class gets a small concurrency group for these methods so a busy
work method cannot block death monitoring or progress reads.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from erlay.supervisor import failpoints
from erlay.supervisor.errors import ChildStartError
from erlay.supervisor.events import EventKind, SupervisorEvent
from erlay.supervisor.health import Quarantine, quarantine_verdict
from erlay.supervisor.imports import import_path
from erlay.supervisor.pidwatch import exit_beacons
from erlay.supervisor.progress import Progress, ProgressSnapshot
from erlay.supervisor.reason import KILLED, SHUTDOWN, ExitKind, ExitReason, from_exception
from erlay.supervisor.runtime import ChildProcess, StartContext, cancel_safe
from erlay.supervisor.spares import SparePool
from erlay.supervisor.spec import (
    DEFAULT_LIVENESS,
    ActorStart,
    ChildSpec,
    Shutdown,
    ShutdownKind,
    boot_ahead_children,
)

log = logging.getLogger("erlay.supervisor")

CONFIRM_DEATH_S = 10.0
_CLASSES: dict[type, Any] = {}


def _actor_info() -> dict[str, Any]:
    ctx = ray.get_runtime_context()
    return {"kind": "actor", "pid": os.getpid(), "node_id": ctx.get_node_id(),
            "actor_id": ctx.get_actor_id(), "actor_name": ctx.get_actor_name(),
            "exit_tids": exit_beacons()}


def _snapshot(obj: Any) -> dict[str, Any] | None:
    progress = getattr(obj, "progress", None)
    return progress.snapshot().to_dict() if isinstance(progress, Progress) else None


def _is_async_class(cls: type) -> bool:
    return any(inspect.iscoroutinefunction(getattr(cls, name, None))
               for name in dir(cls) if not name.startswith("__"))


INIT_ENV = "ERLAY_ACTOR_INIT"
_INIT_DONE = False


def _run_init_hooks() -> None:
    """Run, once per actor process and before it counts as started, each function named in
    ``ERLAY_ACTOR_INIT`` (comma-separated ``module:function`` paths).  The job names
    :func:`erlay.supervisor.node.numa.bind_from_env` there to bind GPU workers to their
    GPU's NUMA node; the OTP core itself knows nothing of nodes.  A failing hook is logged:
    a slower worker beats no worker."""
    global _INIT_DONE
    if _INIT_DONE:
        return
    _INIT_DONE = True
    for path in filter(None, (p.strip() for p in os.environ.get(INIT_ENV, "").split(","))):
        try:
            import_path(path, "actor init hook")()
        except Exception:  # a hook is best effort by contract; never a failed start
            log.warning("actor init hook %s failed; the actor runs without it", path,
                        exc_info=True)


def supervised_class(cls: type) -> Any:
    """The remote class for ``cls`` with erlay's monitor methods added (cached)."""
    if cls in _CLASSES:
        return _CLASSES[cls]
    if _is_async_class(cls):
        async def _erlay_ready(self: Any) -> dict[str, Any]:
            _run_init_hooks()
            hook = getattr(self, "erlay_ready", None)
            if hook is not None:
                result = hook()
                if inspect.isawaitable(result):
                    await result
            return _actor_info()

        async def _erlay_monitor(self: Any) -> Any:
            hook = getattr(self, "erlay_wait", None)
            if hook is not None:
                return await hook()
            await asyncio.Event().wait()
            return None

        async def _erlay_progress(self: Any) -> dict[str, Any] | None:
            return _snapshot(self)

        async def _erlay_stop(self: Any) -> bool:
            hook = getattr(self, "erlay_terminate", None)
            if hook is not None:
                result = hook()
                if inspect.isawaitable(result):
                    await result
            return True

        async def _erlay_failpoints(self: Any, op: str, name: str | None = None,
                                    spec: dict[str, Any] | None = None) -> dict[str, Any]:
            report = failpoints.control(op, name, spec)  # dict updates only: never blocks
            hook = getattr(self, "erlay_failpoints_changed", None)
            if hook is not None:  # a host arms its worker processes too (bounded there)
                await hook(op, name, spec)
            return report

        methods = dict(_erlay_ready=_erlay_ready, _erlay_monitor=_erlay_monitor,
                       _erlay_progress=_erlay_progress, _erlay_stop=_erlay_stop,
                       _erlay_failpoints=_erlay_failpoints)
        options: dict[str, Any] = {}
    else:
        group = ray.method(concurrency_group="_erlay")

        def _erlay_ready_s(self: Any) -> dict[str, Any]:
            _run_init_hooks()
            hook = getattr(self, "erlay_ready", None)
            if hook is not None:
                hook()
            return _actor_info()

        def _erlay_monitor_s(self: Any) -> Any:
            hook = getattr(self, "erlay_wait", None)
            if hook is not None:
                return hook()
            import threading
            threading.Event().wait()
            return None

        def _erlay_progress_s(self: Any) -> dict[str, Any] | None:
            return _snapshot(self)

        def _erlay_stop_s(self: Any) -> bool:
            hook = getattr(self, "erlay_terminate", None)
            if hook is not None:
                hook()
            return True

        def _erlay_failpoints_s(self: Any, op: str, name: str | None = None,
                                spec: dict[str, Any] | None = None) -> dict[str, Any]:
            return failpoints.control(op, name, spec)

        # In the _erlay group, so a work method hung in a failpoint can still be disarmed.
        methods = {"_erlay_ready": group(_erlay_ready_s), "_erlay_monitor": group(_erlay_monitor_s),
                   "_erlay_progress": group(_erlay_progress_s),
                   "_erlay_stop": group(_erlay_stop_s),
                   "_erlay_failpoints": group(_erlay_failpoints_s)}
        options = {"concurrency_groups": {"_erlay": 4}}
    methods["__init__"] = _init_keeping_incarnation(cls)
    if cls.__repr__ is object.__repr__:  # a class's own repr wins
        methods["__repr__"] = _tree_repr
    sub = type(cls.__name__, (cls,), methods)
    sub.__qualname__ = cls.__qualname__
    sub.__module__ = cls.__module__
    remote = ray.remote(**options)(sub) if options else ray.remote(sub)
    _CLASSES[cls] = remote
    return remote


def _init_keeping_incarnation(cls: type) -> Any:
    """An ``__init__`` that keeps the starter's ``_erlay_incarnation`` for :func:`_tree_repr`
    and passes everything else to ``cls``'s."""
    def __init__(self: Any, *args: Any, _erlay_incarnation: int = 0, **kwargs: Any) -> None:
        self._erlay_incarnation = _erlay_incarnation
        cls.__init__(self, *args, **kwargs)

    return __init__


def _tree_repr(self: Any) -> str:
    """``erlay/generation/engine-0 running inc=2``: Ray takes this, once the actor's
    ``__init__`` has returned, as the dashboard's Repr column (and its log prefix).  The
    actor is one incarnation of that child, so "running" holds for the actor's whole life;
    Ray's own State column says when it is dead."""
    try:
        name = ray.get_runtime_context().get_actor_name() or type(self).__name__
    except Exception:  # noqa: BLE001 - outside an actor (a plain instance in a test)
        name = type(self).__name__
    incarnation = getattr(self, "_erlay_incarnation", 0)
    if incarnation == 0:   # a warm spare (erlay.supervisor.spares): Ray takes this once
        return f"{name} built as a spare (erlay status: the child it serves)"
    return f"{name} running inc={incarnation}"


async def _get(ref: Any) -> Any:
    return await ref


@dataclass(frozen=True)
class PreferNode:
    """Placement resolved at each start: on ``node_id`` while that node is alive, else
    wherever Ray's scheduler puts it.

    Ray's soft node affinity was seen to place actors off a live, idle node shortly after it
    joined, so erlay pins hard to a live node and drops the pin once the node is dead.
    """

    node_id: str

    def resolve(self) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if self.node_id in alive:
            return NodeAffinitySchedulingStrategy(self.node_id, soft=False)
        return "DEFAULT"


def death_reason(exc: BaseException) -> ExitReason:
    """Classify Ray's actor death into an exit reason; a dead node is ``lost``."""
    text = " ".join(str(exc).split())
    lower = text.lower()
    if "node" in lower and ("died" in lower or "dead" in lower) \
            and "worker process has died" not in lower:
        return ExitReason(ExitKind.LOST, "node died")
    exit_type = re.search(r"Worker exit type: (\w+)", text)
    detail = re.search(r"Worker exit detail: ([^.]*)", text)
    if exit_type or detail:
        summary = ": ".join(m.group(1) for m in (exit_type, detail) if m)
    else:
        summary = text[:120]
    return ExitReason(ExitKind.ERROR, f"actor process died ({summary})")


class ActorProcess:
    """One incarnation of an actor child.  ``handle`` is the Ray actor handle."""

    def __init__(self, handle: Any, ctx: StartContext, info: dict[str, Any],
                 quarantine_timeout_s: float, probe_interval_s: float) -> None:
        self.handle = handle
        self.ctx = ctx
        self.info = {**info, "actor_name": info.get("actor_name") or ctx.path}
        self._monitor = handle._erlay_monitor.remote()
        self._forced: ExitReason | None = None
        self._quarantine_timeout_s = quarantine_timeout_s
        self._probe_interval_s = probe_interval_s
        self._pump: asyncio.Task[None] | None = None
        self._cursor = 0   # events of a host actor forwarded so far

    async def wait(self) -> ExitReason:
        while True:
            try:
                result = await self._monitor
            except ActorUnavailableError as exc:
                if await self._quarantine(exc) is Quarantine.RECOVERED:
                    self._monitor = self.handle._erlay_monitor.remote()
                    continue
                self._discard()
                return self._forced or ExitReason(ExitKind.LOST, "unreachable past quarantine")
            except (ActorDiedError, RayActorError) as exc:
                self._discard()
                return self._forced or death_reason(exc)
            # The monitor returned: the child ended by itself (erlay_wait).  A host's last
            # events (its children's exits, its local supervisor's escalation) go up first.
            await self._drain_events()
            await self._confirm_death()
            if self._forced is not None:
                return self._forced
            return ExitReason.from_dict(result) if isinstance(result, dict) else \
                ExitReason(ExitKind.NORMAL)

    async def _quarantine(self, exc: BaseException) -> Quarantine:
        loop = asyncio.get_running_loop()
        since = loop.time()
        self.ctx.notify(EventKind.QUARANTINE, f"unreachable: {type(exc).__name__}")
        while True:
            await asyncio.sleep(self._probe_interval_s)
            try:
                await asyncio.wait_for(_get(self.handle._erlay_progress.remote()),
                                       self._probe_interval_s)
                probe: bool | None = True
            except (ActorDiedError, RayActorError) as err:
                probe = None if isinstance(err, ActorUnavailableError) else False
            except TimeoutError:
                probe = None
            verdict = quarantine_verdict(since, probe, loop.time(), self._quarantine_timeout_s)
            if verdict is Quarantine.RECOVERED:
                self.ctx.notify(EventKind.RECOVERED, "answered a probe")
            if verdict is not Quarantine.PROBE:
                return verdict

    def _discard(self) -> None:
        """Make sure the incarnation is gone and its Ray name is free for the next one."""
        if self._pump is not None:
            self._pump.cancel()
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self._sigkill_if_local()

    def _sigkill_if_local(self) -> None:
        # ray.kill of a stopped (SIGSTOP) process lets it linger ~5 s before the raylet
        # kills it; on our own node we finish the job at once.
        pid = self.info.get("pid")
        if pid and self.info.get("node_id") == ray.get_runtime_context().get_node_id():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    async def _confirm_death(self) -> None:
        """Kill the incarnation and wait until Ray reports it dead, so that no child
        outlives the moment its supervisor records the exit."""
        self._discard()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONFIRM_DEATH_S
        while loop.time() < deadline:
            try:
                await asyncio.wait_for(_get(self.handle._erlay_progress.remote()), 1.0)
            except (ActorDiedError, RayActorError) as exc:
                if not isinstance(exc, ActorUnavailableError):
                    await self._wait_local_exit(deadline - loop.time())
                    return
            except TimeoutError:
                pass
            await asyncio.sleep(0.02)
        log.warning("%s: no death confirmation within %g s", self.ctx.path, CONFIRM_DEATH_S)

    async def _wait_local_exit(self, budget_s: float) -> None:
        """On our own node, also wait until the process itself is gone (or a zombie): Ray
        reports the death when the worker disconnects, while a big process may still be
        tearing down its memory."""
        pid = self.info.get("pid")
        if not pid or self.info.get("node_id") != ray.get_runtime_context().get_node_id():
            return
        import psutil
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(budget_s, 5.0))
        while loop.time() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return
            except psutil.NoSuchProcess:
                return
            await asyncio.sleep(0.01)

    async def stop(self, shutdown: Shutdown) -> ExitReason:
        """Stop as ``shutdown`` says.  ``infinity`` waits while the child keeps answering its
        heartbeat; one that stops answering (frozen) is killed, so a stop always ends."""
        if shutdown.kind is ShutdownKind.BRUTAL_KILL:
            await self._confirm_death()
            return KILLED
        stopping = asyncio.ensure_future(_get(self.handle._erlay_stop.remote()))
        try:
            if shutdown.kind is ShutdownKind.INFINITY:
                await self._while_alive(stopping)
            else:
                await asyncio.wait_for(stopping, shutdown.timeout_s)
            reason = SHUTDOWN
        except TimeoutError as exc:
            detail = str(exc) or "did not stop within its shutdown timeout"
            reason = ExitReason(ExitKind.KILLED, detail)
        except (ActorDiedError, RayActorError) as exc:
            reason = death_reason(exc)
        except Exception as exc:  # noqa: BLE001 - erlay_terminate raised
            reason = from_exception(exc)
        finally:
            stopping.cancel()
        await self._drain_events()
        await self._confirm_death()
        return reason

    async def _while_alive(self, stopping: asyncio.Future[Any]) -> None:
        """Await ``stopping`` for as long as the child answers its heartbeat; raise
        TimeoutError once it has been silent past its liveness deadline."""
        liveness = self.ctx.spec.liveness or DEFAULT_LIVENESS
        loop = asyncio.get_running_loop()
        last_answer = loop.time()
        while True:
            done, _ = await asyncio.wait({stopping}, timeout=liveness.period_s)
            if done:
                stopping.result()
                return
            try:
                await asyncio.wait_for(_get(self.handle._erlay_progress.remote()),
                                       liveness.period_s)
                last_answer = loop.time()
            except TimeoutError:
                if loop.time() - last_answer > liveness.deadline_s:
                    raise TimeoutError(
                        f"stopped answering its heartbeat while shutting down (silent "
                        f"{loop.time() - last_answer:.1f} s, liveness deadline "
                        f"{liveness.deadline_s:g} s)") from None

    async def kill(self, reason: ExitReason) -> None:
        self._forced = reason
        self._discard()

    async def progress(self, timeout_s: float) -> ProgressSnapshot | None:
        data = await asyncio.wait_for(_get(self.handle._erlay_progress.remote()), timeout_s)
        return ProgressSnapshot.from_dict(data)

    def start_event_pump(self) -> None:
        """Forward events from a host actor's local supervisor into ours."""
        self._pump = asyncio.create_task(self._pump_events(), name=f"{self.ctx.path}:events")

    async def _pump_events(self) -> None:
        while True:
            try:
                events, cursor = await self.handle.events_since.remote(self._cursor, 10.0)
            except (ActorDiedError, RayActorError):
                return
            self._forward(events, cursor)

    def _forward(self, events: list[dict[str, Any]], cursor: int) -> None:
        if cursor <= self._cursor:
            return  # a late answer the drain already forwarded
        sink = self.ctx.supervisor.sink
        skip = len(events) - (cursor - self._cursor)  # events before our cursor
        for data in events[max(0, skip):]:
            sink.emit(SupervisorEvent.from_dict(data))
        self._cursor = cursor

    async def _drain_events(self) -> None:
        """Forward what a host actor still holds, before it is discarded: a child's exit or
        the local supervisor's escalation raised just before the host ends must not be
        lost.  Bounded: a host that cannot answer within 2 s has nothing left to say."""
        if self._pump is None:
            return
        self._pump.cancel()
        try:
            events, cursor = await asyncio.wait_for(
                _get(self.handle.events_since.remote(self._cursor, 0.0)), 2.0)
        except (TimeoutError, ActorDiedError, RayActorError):
            return
        self._forward(events, cursor)


async def _create(remote_cls: Any, opts: dict[str, Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
    """Create the actor; if an old incarnation still holds the name, kill it and retry."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3.0
    while True:
        try:
            return remote_cls.options(**opts).remote(*args, **kwargs)
        except ValueError as exc:
            if "already taken" not in str(exc) or loop.time() > deadline:
                raise
            try:
                ray.kill(ray.get_actor(opts["name"]), no_restart=True)
            except ValueError:
                pass
            await asyncio.sleep(0.02)


def _creation(spec: ActorStart, path: str, incarnation: int, args: tuple[Any, ...]
              ) -> tuple[Any, dict[str, Any], tuple[Any, ...], dict[str, Any]]:
    """What ``_create`` needs for one incarnation of the actor child at ``path`` (or, with
    incarnation 0, for a spare named ``path``)."""
    remote_cls = supervised_class(spec.cls)
    opts = {"num_cpus": 0, **spec.options, "max_restarts": 0, "name": path}
    if isinstance(opts.get("scheduling_strategy"), PreferNode):
        opts["scheduling_strategy"] = opts["scheduling_strategy"].resolve()
    kwargs = {**spec.kwargs, "_erlay_incarnation": incarnation}
    if getattr(spec.cls, "_erlay_wants_path", False):
        kwargs["erlay_path"] = path
    return remote_cls, opts, (*spec.args, *args), kwargs


def actor_starter(*, ready_timeout_s: float = 120.0, quarantine_timeout_s: float = 30.0,
                  probe_interval_s: float = 0.5) -> Any:
    """A starter for :class:`ActorStart` children (see :mod:`erlay.supervisor.runtime`).

    The starter also carries ``launch_ahead(root, children)`` and ``discard_ahead()``, which
    the tree calls around its boot for ``boot_ahead`` children: the first creates those
    actors at once and asks each for ``erlay_ready`` (Ray queues the call behind the
    constructor), and a boot start of the same path (incarnation 1) then adopts the actor
    and awaits that same answer; the second kills whatever the boot never reached.

    It also owns the tree's warm spares (``spares``, :mod:`erlay.supervisor.spares`): every
    start that adopts no boot-ahead actor adopts a spare when one is there, and refills.
    """
    # path -> (actor, its pending _erlay_ready) created at the tree's boot, not yet started
    ahead: dict[str, tuple[Any, Any]] = {}

    async def create_spare(spec: ActorStart, name: str) -> tuple[Any, Any]:
        handle = await _create(*_creation(spec, name, 0, ()))
        return handle, handle._erlay_ready.remote()

    spares = SparePool(create_spare)

    async def start(ctx: StartContext) -> ChildProcess:
        start_spec = ctx.spec.start
        assert isinstance(start_spec, ActorStart)
        timeout_s = start_spec.ready_timeout_s or ready_timeout_s
        supervisor = ctx.path.rsplit("/", 1)[0]
        adopted = ahead.pop(ctx.path, None) if ctx.incarnation == 1 and not ctx.args \
            else None
        spare = None
        if adopted is None and start_spec.spares and not ctx.args:
            # A restart, or a start under a supervisor its parent restarted (spares outlive it)
            spare = await spares.take(supervisor, start_spec, timeout_s)
        if spare is not None:
            log.info("%s: adopted spare %s (built %.1f s ago)", ctx.path, spare.name,
                     spare.age_s)
            proc = ActorProcess(spare.handle, ctx, spare.info, quarantine_timeout_s,
                                probe_interval_s)
            spares.fill(supervisor, start_spec, delay_s=start_spec.spare_delay_s)
            return proc
        if adopted is None:
            handle = await _create(*_creation(start_spec, ctx.path, ctx.incarnation, ctx.args))
            ready = handle._erlay_ready.remote()
        else:
            handle, ready = adopted
        try:
            info = await asyncio.wait_for(_get(ready), timeout_s)
        except BaseException as exc:  # noqa: BLE001 - cancelled too: never leak the actor
            ray.kill(handle, no_restart=True)
            if isinstance(exc, TimeoutError):
                raise ChildStartError(ctx.path, f"not ready within {timeout_s:g} s") \
                    from None
            raise ChildStartError(ctx.path, _start_failure(exc)) from None
        proc = ActorProcess(handle, ctx, info, quarantine_timeout_s, probe_interval_s)
        if getattr(start_spec.cls, "_erlay_event_source", False):
            proc.start_event_pump()
        if start_spec.spares and not ctx.args:
            spares.fill(supervisor, start_spec, delay_s=start_spec.spare_first_delay_s
                        if ctx.incarnation == 1 else start_spec.spare_delay_s)
        return proc

    cancel_safe(start)   # its ready wait kills the actor on any exit, cancellation included

    async def launch_ahead(root: str, children: Sequence[ChildSpec]) -> list[str]:
        """Create every ``boot_ahead`` actor of the tree ``root`` now; returns their paths.

        An actor that cannot be created (bad options, a name still held) is left to its turn,
        where the same error becomes that child's start failure, named, like any other."""
        for path, spec in boot_ahead_children(root, children):
            try:
                handle = await _create(*_creation(spec, path, 1, ()))
            except Exception as exc:  # noqa: BLE001 - reported by the start at its turn
                log.info("%s: not created ahead (%r); it is created at its turn", path, exc)
                continue
            ahead[path] = (handle, handle._erlay_ready.remote())
        return list(ahead)

    def discard_ahead() -> list[str]:
        """Kill the actors created ahead that no start adopted (the boot failed first)."""
        left = list(ahead)
        for handle, _ in ahead.values():
            ray.kill(handle, no_restart=True)
        ahead.clear()
        return left

    start.launch_ahead = launch_ahead  # type: ignore[attr-defined]
    start.discard_ahead = discard_ahead  # type: ignore[attr-defined]
    start.spares = spares  # type: ignore[attr-defined]
    return start


def _start_failure(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or getattr(exc, "__cause__", None)
    if isinstance(exc, RayActorError) and "__init__" in str(exc):
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return lines[-1].strip() if lines else "actor constructor failed"
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    return f"{type(exc).__name__}: {exc}".splitlines()[0]

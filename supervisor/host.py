"""The node host: one Ray actor per (node, fault domain) that hosts light children.

Sandbox workers, judge workers and environment workers do not each get a Ray actor.  They
run inside the host of their node and domain, as in-process objects, subprocesses or worker
processes (:mod:`erlay.supervisor.worker_process`: code that may freeze, one call at a time,
each under a deadline; :meth:`NodeHost.submit` hands calls to whichever is free), under a
local :class:`~erlay.supervisor.runtime.Supervisor` that restarts them with no Ray control-plane
traffic.  This keeps GCS registrations at O(nodes x domains).

The host is itself an actor child of its domain supervisor.  If its local supervisor gives
up (restart intensity exceeded), ``erlay_wait`` returns that reason and the domain supervisor
sees the host exit.  If the host's process or node dies, the domain supervisor restarts it;
with soft node affinity the new host lands on a node that is alive and boots the same
children there.

The host owns its children's process groups (:class:`~erlay.supervisor.procs.ProcessKeeper`): when
a child or the host stops, nothing they spawned survives, and a reaper covers a SIGKILLed
host.  ``env`` is forwarded to every subprocess the host spawns.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

from erlay.supervisor.actor_child import PreferNode
from erlay.supervisor.errors import ChildNotRunning
from erlay.supervisor.events import CallbackSink, FanoutSink, LoggingSink, MemorySink
from erlay.supervisor.failpoints import afailpoint
from erlay.supervisor.hosted import InProcessChild
from erlay.supervisor.naming import host_id
from erlay.supervisor.procs import process_keeper
from erlay.supervisor.runtime import ChildProcess, StartContext, Supervisor
from erlay.supervisor.spec import (
    ActorStart,
    ChildSpec,
    InProcessStart,
    SubprocessStart,
    SupervisorFlags,
    WorkerStart,
)
from erlay.supervisor.subprocess_child import SubprocessChild
from erlay.supervisor.worker_process import (
    ARMED,
    CallOutcome,
    WorkerCall,
    WorkerPool,
    WorkerProcess,
)

log = logging.getLogger("erlay.supervisor")


class NodeHost:
    """Hosts in-process and subprocess children for one node and fault domain."""

    _erlay_event_source = True   # the actor starter pumps our events to the parent
    _erlay_wants_path = True     # the actor starter passes erlay_path=<tree path>

    def __init__(self, flags: SupervisorFlags, children: tuple[ChildSpec, ...],
                 env: Mapping[str, str] | None = None,
                 instances: tuple[tuple[Any, ...], ...] = (), *, erlay_path: str) -> None:
        self.path = erlay_path
        self.flags = flags
        self.children = tuple(children)
        self.env = dict(env or {})
        self.instances = tuple(instances)
        self.events = MemorySink()
        self.keeper = process_keeper()
        self.keeper.declared_env.update(self.env)
        self.sup: Supervisor | None = None
        self._new_event: asyncio.Event | None = None
        self.pool = WorkerPool(self._worker_processes)

    # -- lifecycle hooks used by the actor starter ---------------------------------------
    async def erlay_ready(self) -> None:
        self._new_event = asyncio.Event()
        sink = FanoutSink([self.events, LoggingSink(),
                           CallbackSink(lambda _e: self._new_event.set())])  # type: ignore[union-attr]
        starters = {InProcessStart: partial(_spawn, InProcessChild.start),
                    SubprocessStart: partial(_spawn, partial(SubprocessChild.start,
                                                             keeper=self.keeper)),
                    WorkerStart: partial(_spawn, partial(WorkerProcess.start,
                                                         keeper=self.keeper))}
        self.sup = Supervisor(self.path, self.flags, self.children, starters=starters, sink=sink)
        await self.sup.boot()
        # A simple_one_for_one host re-creates its pool at every boot, so a host restarted
        # on another node comes back with the same workers (erlay extension).
        for args in self.instances:
            await self.sup.start_child(args=tuple(args))

    async def erlay_wait(self) -> dict[str, Any]:
        reason = await self._sup().wait_exit()
        self.keeper.close()
        return reason.to_dict()

    async def erlay_terminate(self) -> None:
        await self._sup().shutdown()
        self.keeper.close()

    def _sup(self) -> Supervisor:
        if self.sup is None:
            raise ChildNotRunning(f"{self.path} has not booted")
        return self.sup

    # -- calls into hosted children -------------------------------------------------------
    async def call(self, child_id: str, method: str, args: tuple[Any, ...] = (),
                   kwargs: Mapping[str, Any] | None = None) -> Any:
        """Call a method of an in-process child; raises ChildNotRunning while it restarts."""
        child = self._sup().child(child_id)
        if not isinstance(child, InProcessChild):
            raise ChildNotRunning(f"{self.path}/{child_id} is not a running in-process child")
        return await child.call(method, *args, **dict(kwargs or {}))

    async def ping(self) -> int:
        return os.getpid()

    # -- worker processes ----------------------------------------------------------------
    def _worker_processes(self) -> list[WorkerProcess]:
        sup = self.sup
        if sup is None:
            return []
        procs = (sup.child(cid) for cid in sup.children_ids())
        return [p for p in procs if isinstance(p, WorkerProcess)]

    async def submit(self, calls: list[WorkerCall],
                     queue_timeout_s: float = 60.0) -> list[CallOutcome]:
        """Run ``calls`` on this host's worker processes, each on the first one free, first
        come first served; the outcomes in the calls' order.  A call waits at most
        ``queue_timeout_s`` for a free worker (else its outcome is ``lost``), then its own
        deadline.  Never raises for what a worker or its code does."""
        return list(await asyncio.gather(*(self.pool.run(call, queue_timeout_s)
                                           for call in calls)))

    async def worker_stats(self) -> dict[str, dict[str, Any]]:
        """Each running worker process's counters (calls, outcomes, replacements)."""
        return {w.path.rsplit("/", 1)[-1]: w.stats() for w in self._worker_processes()}

    async def erlay_failpoints_changed(self, op: str, name: str | None,
                                       spec: dict[str, Any] | None) -> None:
        """A failpoint armed in this host is armed in its worker processes too (chaos: a
        user's code failing there): the ones running now, and, unless it fires a bounded
        number of times (``count``, ``nth``: those count per process, and a replacement armed
        again would fire again), every one started later."""
        match op:
            case "arm" if name is not None and spec is not None:
                if spec.get("count") is None and spec.get("nth") is None:
                    ARMED[name] = dict(spec)
                else:
                    ARMED.pop(name, None)
            case "disarm" if name is not None:
                ARMED.pop(name, None)
            case "disarm_all":
                ARMED.clear()
        await asyncio.gather(*(w.control(op, name, spec) for w in self._worker_processes()))

    # -- the dynamic API, forwarded --------------------------------------------------------
    async def start_child(self, spec: ChildSpec | None = None, args: tuple[Any, ...] = ()) -> str:
        return await self._sup().start_child(spec, args)

    async def terminate_child(self, child_id: str) -> None:
        await self._sup().terminate_child(child_id)

    async def restart_child(self, child_id: str) -> str:
        return await self._sup().restart_child(child_id)

    async def delete_child(self, child_id: str) -> None:
        await self._sup().delete_child(child_id)

    async def which_children(self) -> list[dict[str, Any]]:
        return self._sup().which_children()

    async def count_children(self) -> dict[str, int]:
        return self._sup().count_children()

    async def events_since(self, cursor: int, wait_s: float) -> tuple[list[dict[str, Any]], int]:
        """Long-poll: events numbered >= cursor, waiting up to ``wait_s`` for the first."""
        events, total = self.events.since(cursor)
        if not events and self._new_event is not None:
            self._new_event.clear()
            try:
                await asyncio.wait_for(self._new_event.wait(), wait_s)
            except TimeoutError:
                pass
            events, total = self.events.since(cursor)
        return [e.to_dict() for e in events], total

    async def signal_child(self, child_id: str, sig: int = signal.SIGKILL) -> int:
        """Send a signal to a subprocess child's main process (fault injection); its pid."""
        child = self._sup().child(child_id)
        if not isinstance(child, SubprocessChild):
            raise ChildNotRunning(f"{self.path}/{child_id} is not a running subprocess child")
        os.kill(child.pid, sig)
        return child.pid

    async def process_groups(self) -> list[int]:
        return sorted(self.keeper.groups)


async def _spawn(start: Callable[[StartContext], Awaitable[ChildProcess]],
                 ctx: StartContext) -> ChildProcess:
    """Start one hosted child, past the ``host.spawn`` failpoint: a fault there is a start
    failure of that child (at boot it aborts the host's boot)."""
    await afailpoint("host.spawn")
    return await start(ctx)


def host_spec(node_label: str, flags: SupervisorFlags, children: tuple[ChildSpec, ...],
              *, node_id: str | None = None, env: Mapping[str, str] | None = None,
              instances: tuple[tuple[Any, ...], ...] = (), restart: str = "permanent",
              shutdown: float | str = "infinity",
              options: Mapping[str, Any] | None = None,
              boot_ahead: bool = False) -> ChildSpec:
    """The child spec of the host for one node: id ``host@<node>``.

    The host is pinned to its node while the node lives; a restart after the node is gone
    places it on a live node (see :class:`~erlay.supervisor.actor_child.PreferNode`).
    For a simple_one_for_one host, ``instances`` lists the start args of the instances it
    starts at every boot.  ``options`` are added to the host actor's ``.options()`` (e.g. a
    ``runtime_env`` for the host process itself; ``env`` is for what the host spawns).
    ``boot_ahead`` is :class:`~erlay.supervisor.spec.ActorStart`'s.
    """
    opts: dict[str, Any] = {"num_cpus": 0, **(options or {})}
    if node_id is not None:
        opts["scheduling_strategy"] = PreferNode(node_id)
    start = ActorStart(NodeHost, args=(flags, tuple(children), dict(env or {}),
                                       tuple(tuple(a) for a in instances)), options=opts,
                       boot_ahead=boot_ahead)
    return ChildSpec(host_id(node_label), start, restart=restart, shutdown=shutdown,
                     type="supervisor")

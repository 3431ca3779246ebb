"""Warm spares: actors built ahead of need, so that a restart adopts one instead of building.

A deviation from OTP (an OTP restart always runs the child's start function).  An actor
child whose :class:`~erlay.supervisor.spec.ActorStart` sets ``spares=n`` keeps up to ``n``
constructed and ready actors beside it, under its supervisor's path
(``<supervisor>/spare-<k>``).  When one of the supervisor's children with an *equal* start
spec starts again (a restart, or its start under a supervisor that was itself restarted;
any start but one that adopts a boot-ahead actor), the starter adopts a spare: the new
incarnation is that actor, whose process has long since imported its code, built its model
and run its ready hook.  What is
left on the restart's critical path is the check that the spare still answers, and whatever
the child's clients do with a new incarnation (an engine pool's weight load).

Contracts:

- A spare is created with the start spec of the child that asked for it, and is adopted only
  by a child whose start spec equals that one (engines built from one spec share a pool;
  learner ranks with different arguments never swap).  Equal specs build identical actors,
  so adopting one is the same as building one, only earlier.
- Adoption checks that the spare finished its ready hook (waiting for it, within the start's
  ready timeout, if it has not: a spare still loading is further along than a new actor)
  and that it answers a progress probe within :data:`PROBE_S`.  A spare that died, failed its
  constructor or froze is killed and logged, and the restart builds a new actor instead:
  a bad spare costs the time of its probe, never the restart.
- The pool is refilled after every adoption, ``spare_delay_s`` later (the start's), so the
  replacement spare's start-up (a new process importing torch, building a model) does not
  compete for the node's CPUs with the failover of the failed child's work.  The first
  spares are made ``spare_first_delay_s`` after the first child of the spec has started,
  so that they do not compete with the rest of the boot either.
- Spares belong to the tree: they survive a restart of their supervisor (its children
  adopt them as they would have before) and are killed when the tree closes
  (:meth:`SparePool.discard`), so none outlives the job.  They hold no work, so nothing is
  lost with one.
- A spare is not a child: it has no liveness heartbeat and no restart intensity; its death
  is noticed at its adoption (above) or never.  The dashboard lists it under its spare name
  before and after its adoption (Ray names an actor once); the supervision tree, ``erlay
  status`` and the events name it by the child's path it serves.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from erlay.supervisor.spec import ActorStart

log = logging.getLogger("erlay.supervisor")

PROBE_S = 2.0   # a spare that cannot answer a progress probe this fast is not adopted

# (spec, supervisor path, spare name) -> (actor handle, its pending _erlay_ready reference)
Create = Callable[[ActorStart, str], Awaitable[tuple[Any, Any]]]


@dataclass
class Spare:
    """One actor built ahead: its handle, its pending ready call, and when it was made."""

    spec: ActorStart
    name: str
    handle: Any
    ready: Any
    created_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Adopted:
    """A spare taken for a restart: the actor, its ready answer (the ``info`` of
    :class:`~erlay.supervisor.actor_child.ActorProcess`) and the spare's age."""

    handle: Any
    info: dict[str, Any]
    name: str
    age_s: float


async def _get(ref: Any) -> Any:
    return await ref


class SparePool:
    """The spares of one tree, by supervisor path.  Runs on the tree's event loop.

    ``create(spec, name)`` makes one actor of ``spec`` named ``name`` and asks it for its
    ready answer (the actor starter's creation); the pool never builds actors itself.
    """

    def __init__(self, create: Create) -> None:
        self._create = create
        self._spares: dict[str, list[Spare]] = {}
        self._specs: list[ActorStart] = []   # distinct specs seen, for the fill's key
        self._filling: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._names = itertools.count(1)
        self._closed = False
        self.adopted = 0       # spares taken by a restart
        self.rejected = 0      # spares found dead, failed or frozen at adoption

    def count(self, supervisor: str, spec: ActorStart) -> int:
        """Spares held (ready or still building) for ``spec`` under ``supervisor``."""
        return sum(1 for s in self._spares.get(supervisor, ()) if s.spec == spec)

    def names(self) -> list[str]:
        """Every spare's actor name (for logs and tests)."""
        return [s.name for spares in self._spares.values() for s in spares]

    def fill(self, supervisor: str, spec: ActorStart, *, delay_s: float = 0.0) -> None:
        """Make spares of ``spec`` under ``supervisor`` until it holds ``spec.spares``, after
        ``delay_s``, in the background.  At most one fill per (supervisor, spec) runs; a
        fill asked for while one runs is folded into it."""
        if self._closed or spec.spares <= 0:
            return
        if spec not in self._specs:
            self._specs.append(spec)
        key = (supervisor, self._specs.index(spec))   # equal specs share one fill
        task = self._filling.get(key)
        if task is not None and not task.done():
            return
        task = asyncio.get_running_loop().create_task(
            self._fill(supervisor, spec, delay_s), name=f"spares:{supervisor}")
        self._filling[key] = task
        task.add_done_callback(_log_failure)

    async def _fill(self, supervisor: str, spec: ActorStart, delay_s: float) -> None:
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        while not self._closed and self.count(supervisor, spec) < spec.spares:
            name = f"{supervisor}/spare-{next(self._names)}"
            handle, ready = await self._create(spec, name)
            if self._closed:   # closed while creating: it must not outlive the tree
                ray.kill(handle, no_restart=True)
                return
            self._spares.setdefault(supervisor, []).append(Spare(spec, name, handle, ready))
            log.info("%s: spare %s building", supervisor, name)

    async def take(self, supervisor: str, spec: ActorStart, ready_timeout_s: float
                   ) -> Adopted | None:
        """A spare of ``spec`` under ``supervisor`` that is ready and answers, or None (the
        caller builds a new actor).  Rejected spares are killed; the pool is not refilled
        here (the caller does, after its start)."""
        spares = self._spares.get(supervisor, [])
        while True:
            spare = next((s for s in spares if s.spec == spec), None)
            if spare is None:
                return None
            spares.remove(spare)
            try:
                info = await asyncio.wait_for(_get(spare.ready), ready_timeout_s)
                await asyncio.wait_for(_get(spare.handle._erlay_progress.remote()), PROBE_S)
            except Exception as exc:  # noqa: BLE001 - any failure: a bad spare, not a bad start
                self.rejected += 1
                log.warning("%s: spare %s not adopted (%s: %s); building a new actor",
                            supervisor, spare.name, type(exc).__name__, str(exc)[:200])
                ray.kill(spare.handle, no_restart=True)
                continue
            self.adopted += 1
            return Adopted(spare.handle, info, spare.name, time.time() - spare.created_at)

    def discard(self) -> list[str]:
        """Kill every spare and stop filling; returns the names killed.  Idempotent."""
        self._closed = True
        for task in self._filling.values():
            task.cancel()
        self._filling.clear()
        killed = []
        for spares in self._spares.values():
            for spare in spares:
                try:
                    ray.kill(spare.handle, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
                killed.append(spare.name)
        self._spares.clear()
        return killed


def _log_failure(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.warning("spare fill failed: %s: %s", type(exc).__name__, exc)

"""Calls into the worker processes of one domain's node hosts, as the coordinator makes them.

:class:`HostCalls` is how the coordinator reaches user code (the environment, the judge):
each call is a :class:`~erlay.supervisor.worker_process.WorkerCall` that some node host runs
on one of its worker processes (:meth:`erlay.supervisor.host.NodeHost.submit`).  The calls
made in one event-loop turn travel together, one Ray call per host, so a step's 256
environment calls cost a few Ray round trips, not 256.

Contracts:

- **Never raises for the callee.**  Every call ends in a
  :class:`~erlay.supervisor.worker_process.CallOutcome`.  A host that dies, is restarting, or
  does not answer the batch within its deadline gives each of the batch's calls a ``lost``
  outcome, for the caller to retry.
- **Every wait is bounded.**  A batch's deadline is the host's queue bound plus the longest
  call deadline in it plus :data:`MARGIN_S`; a call finds a running host within
  ``host_wait_s`` or is ``lost``.
- Hosts are used round robin, one batch per host per turn.  With ``breaker``, each host has
  a circuit breaker (:class:`erlay.judges.budget.CircuitBreaker`) that counts *the host's*
  failures only: a ``lost`` outcome is one; any answer from a worker (``ok``, and a user's
  ``timeout`` or ``died`` too) is a success of the host.  A host whose breaker is open gets
  no calls until its cool-down ends; when every breaker is open, a call waits for one at
  most one cool-down, then is ``lost``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from erlay.actors.control.limits import CallLimits
from erlay.actors.job.domains import CHILD_GONE, wait_for_any
from erlay.judges.budget import CircuitBreaker
from erlay.supervisor.deadline import within
from erlay.supervisor.tree import ChildRef, SupervisionTree
from erlay.supervisor.worker_process import CallOutcome, WorkerCall

log = logging.getLogger("erlay.rollout")

MARGIN_S = 30.0   # a batch's deadline beyond its calls': the Ray hops, a busy host


class HostCalls:
    """Runs :class:`WorkerCall` s on the worker processes of ``hosts`` (tree paths).

    ``call_timeout_s`` is the deadline of a call that names none; ``queue_timeout_s`` how
    long a call may wait at its host for a free worker process."""

    def __init__(self, tree: SupervisionTree, hosts: list[str], *, call_timeout_s: float,
                 queue_timeout_s: float = 60.0, host_wait_s: float = 60.0,
                 breaker: Callable[[], CircuitBreaker] | None = None,
                 limits: CallLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.refs = [tree.ref(p) for p in hosts]
        # With the goodput controller: a slot under each host's concurrency limit, and the
        # latency of each answered call (the deadline itself is the caller's WorkerCall's).
        self.limits = limits
        self.call_timeout_s = call_timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.host_wait_s = host_wait_s
        self.clock = clock
        self.breakers = {ref.path: breaker() for ref in self.refs} if breaker else {}
        self.batches = 0
        self._next = itertools.count()
        self._waiting: dict[str, tuple[ChildRef, list[tuple[WorkerCall,
                                                            asyncio.Future[CallOutcome]]]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, call: WorkerCall) -> CallOutcome:
        """The outcome of ``call`` on some host's worker process."""
        host = await self._pick()
        if isinstance(host, CallOutcome):
            return host
        if self.limits is None:
            outcome = await self._queue(host, call)
        else:
            async with self.limits.slot(host.path):
                started = self.clock()
                outcome = await self._queue(host, call)
            # A lost call is the host's failure (dead, restarting, or not answering in
            # time): congestion; a timeout is the user code's.
            self.limits.record(host.path, self.clock() - started,
                               timed_out=outcome.kind != "ok", congested=outcome.kind == "lost")
        breaker = self.breakers.get(host.path)
        if breaker is not None:
            if outcome.kind == "lost":
                breaker.record_failure(self.clock())
            else:
                breaker.record_success(self.clock())
        return outcome

    async def _pick(self) -> ChildRef | CallOutcome:
        """A running host whose breaker admits a call, round robin; or the ``lost``
        outcome that says why there is none."""
        give_up = self.clock() + max((b.cool_down_s for b in self.breakers.values()),
                                     default=0.0) + 1.0
        while True:
            hosts = await wait_for_any(self.refs, self.host_wait_s)
            if not hosts:
                return CallOutcome("lost", detail=f"no host was running within "
                                   f"{self.host_wait_s:g} s")
            n = next(self._next)
            for i in range(len(hosts)):
                host = hosts[(n + i) % len(hosts)]
                breaker = self.breakers.get(host.path)
                if breaker is None or breaker.allow(self.clock()):
                    return host
            if self.clock() > give_up:
                return CallOutcome("lost", detail="every host's circuit is open")
            await asyncio.sleep(0.1)

    async def _queue(self, host: ChildRef, call: WorkerCall) -> CallOutcome:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[CallOutcome] = loop.create_future()
        entry = self._waiting.get(host.path)
        if entry is None:
            entry = self._waiting[host.path] = (host, [])
            loop.call_soon(self._flush, host.path)
        entry[1].append((call, future))
        return await future

    def _flush(self, path: str) -> None:
        host, batch = self._waiting.pop(path)
        task = asyncio.create_task(self._send(host, batch), name=f"submit:{path}")
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    def deadline_s(self, calls: list[WorkerCall]) -> float:
        """How long a batch of ``calls`` may take at its host, at most."""
        longest = max((c.timeout_s or self.call_timeout_s for c in calls),
                      default=self.call_timeout_s)
        return self.queue_timeout_s + longest + MARGIN_S

    async def _send(self, host: ChildRef,
                    batch: list[tuple[WorkerCall, asyncio.Future[CallOutcome]]]) -> None:
        calls = [call for call, _ in batch]
        self.batches += 1
        try:
            outcomes: list[Any] = await within(
                host.actor.submit.remote(calls, self.queue_timeout_s),
                self.deadline_s(calls), f"{host.path}.submit")
        except Exception as exc:  # noqa: BLE001 - every call of the batch is lost, retried
            if not isinstance(exc, CHILD_GONE):
                log.warning("%s.submit failed: %s: %s", host.path, type(exc).__name__, exc)
            first = str(exc).splitlines()[0] if str(exc) else ""
            detail = f"{host.path}: {type(exc).__name__}: {first}"
            outcomes = [CallOutcome("lost", detail=detail[:300]) for _ in batch]
        except BaseException:
            for _, future in batch:
                if not future.done():
                    future.cancel()
            raise
        for (_, future), outcome in zip(batch, outcomes, strict=True):
            if not future.done():
                future.set_result(outcome)

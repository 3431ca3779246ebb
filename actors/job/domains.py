"""Clients the rollout coordinator uses to reach the other fault domains.

Each client follows its children across restarts through the supervision tree (a
:class:`~erlay.supervisor.tree.ChildRef` per child) and turns a child's failure into a retry, a
failover or a marked result, never a crash of the coordinator:

- :class:`EnginePool` picks the least-loaded running engine and *admits* a new incarnation
  only after it has loaded the current weights.
- :class:`SandboxClient` runs a tool call under its idempotency key on a sandbox worker,
  retrying on another worker (or the restarted one) when the worker or its host dies.
- the environment's and the judge's clients live beside these
  (:mod:`~erlay.actors.job.env_client`, :mod:`~erlay.actors.job.judge_client`): they reach
  worker processes of their hosts through :mod:`~erlay.actors.job.hostcalls`.

Every call into another domain carries a deadline (:mod:`erlay.supervisor.deadline`): a
child that does not answer fails the call, which is retried elsewhere or marked, while the
child's own supervisor decides, by heartbeat and progress deadlines, whether it is hung.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from erlay.actors.control.limits import CallLimits
from erlay.actors.engine.api import EngineFailed
from erlay.actors.job.engine_exits import EngineExits
from erlay.actors.model.refit import Refit
from erlay.supervisor.deadline import stream_within, within
from erlay.supervisor.errors import CallDeadlineExceeded, ChildNotRunning
from erlay.supervisor.tree import ChildRef, SupervisionTree

log = logging.getLogger("erlay.rollout")


class EngineRequestFailed(ChildNotRunning):
    """A live engine failed a streamed request (its method raised): fail over, but do not
    count the engine as dead."""


# A child that is restarting or no longer exists (a ChildRef lookup raises ChildNotRunning
# then), whose actor died or became unavailable under the call (RayActorError and its
# subclasses), or that did not answer in time.  Only what means gone: an error of our own
# code (a KeyError, say) is a bug and propagates instead of turning into a failover loop.
CHILD_GONE = (ChildNotRunning, RayActorError, CallDeadlineExceeded)
# An engine is gone too once its decode loop has died (EngineFailed, raised to callers inside
# a RayTaskError): it refuses everything and exits, and its supervisor restarts it.
ENGINE_GONE = (*CHILD_GONE, EngineFailed)


async def wait_for_any(refs: list[ChildRef], timeout_s: float) -> list[ChildRef]:
    """Running children among ``refs``, waiting up to ``timeout_s`` for at least one."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = []
        for ref in refs:
            try:
                ref.process  # noqa: B018 - raises while the child has no incarnation
                running.append(ref)
            except CHILD_GONE:
                continue
        if running or time.monotonic() > deadline:
            return running
        await asyncio.sleep(0.05)


def _admission_done(task: asyncio.Task[None]) -> None:
    """Collect an admission's outcome, so that one nobody awaited is not an unretrieved
    error: a gone engine is retried on its next incarnation, anything else is logged."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, ENGINE_GONE):
        log.warning("admitting %s failed: %s: %s", task.get_name(), type(exc).__name__, exc)


class EnginePool:
    """The generation engines, with admission of new incarnations."""

    def __init__(self, tree: SupervisionTree, paths: list[str], *,
                 update_timeout_s: float = 300.0) -> None:
        self.refs = [tree.ref(p) for p in paths]
        self.update_timeout_s = update_timeout_s
        self.weights: Refit | None = None   # the newest published, loaded on admission
        self._admitted: dict[str, int] = {}
        self._load: dict[str, int] = {p: 0 for p in paths}
        self._admitting: dict[str, tuple[int, asyncio.Task[None]]] = {}
        # The goodput controller's routing (erlay.actors.control): None = least loaded.
        self.router: Callable[[dict[str, int]], str] | None = None

    def load(self, path: str) -> int:
        """Rollouts in flight on the engine at ``path``."""
        return self._load.get(path, 0)

    async def acquire(self, timeout_s: float = 120.0,
                      exclude: frozenset[tuple[str, int]] = frozenset()) -> ChildRef:
        """A running, admitted engine: the one :attr:`router` picks, else the one with the
        fewest requests in flight.

        ``exclude`` holds (path, incarnation) pairs that already failed the caller: an
        engine that just died looks running until its supervisor notices, and a failover
        must not land on it again.  A running engine not admitted yet (a restart loading the
        current weights) is admitted in the background while another engine serves: a
        failover never waits on a restart when there is somewhere else to go."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = await wait_for_any(self.refs, max(0.0, deadline - time.monotonic()))
            admitted, pending = [], []
            for ref in running:
                try:
                    incarnation = ref.incarnation
                except CHILD_GONE:
                    continue
                if (ref.path, incarnation) in exclude:
                    continue
                (admitted if self._admitted.get(ref.path) == incarnation
                 else pending).append(ref)
            if admitted:
                for ref in pending:
                    self._admit_later(ref)
                if self.router is not None and len(admitted) > 1:
                    path = self.router({r.path: self._load[r.path] for r in admitted})
                    ref = next(r for r in admitted if r.path == path)
                else:
                    ref = min(admitted, key=lambda r: self._load[r.path])
                self._load[ref.path] += 1
                return ref
            if time.monotonic() > deadline:
                raise ChildNotRunning("no generation engine is running")
            if not pending or not await self._first_admitted(pending, deadline):
                await asyncio.sleep(0.05)

    def release(self, ref: ChildRef) -> None:
        self._load[ref.path] = max(0, self._load[ref.path] - 1)

    async def _first_admitted(self, refs: list[ChildRef], deadline: float) -> bool:
        """Admit ``refs`` until the first of them serves (True) or none can (False); the
        others' admissions go on.  An error of our own code propagates."""
        waits = [asyncio.ensure_future(self._admit(ref)) for ref in refs]
        try:
            while waits:
                done, _ = await asyncio.wait(waits, timeout=max(0.0, deadline - time.monotonic()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    return False
                for wait in done:
                    waits.remove(wait)
                    try:
                        if wait.result():
                            return True
                    except ENGINE_GONE:
                        continue
            return False
        finally:
            for wait in waits:
                wait.cancel()   # only the wait: the admission itself is shielded

    async def _admit(self, ref: ChildRef) -> bool:
        """Load the current weights into a new incarnation before it serves; True once it
        serves them.  The load is shared by every caller and outlives any that gives up."""
        incarnation = ref.incarnation
        if self._admitted.get(ref.path) == incarnation:
            return True
        if self.weights is None:
            self._admitted[ref.path] = incarnation
            return True
        await asyncio.shield(self._admission(ref, incarnation))
        return self._admitted.get(ref.path) == incarnation

    def _admit_later(self, ref: ChildRef) -> None:
        """Start admitting ``ref`` without waiting for it."""
        try:
            incarnation = ref.incarnation
        except CHILD_GONE:
            return
        if self.weights is None:
            self._admitted[ref.path] = incarnation
        else:
            self._admission(ref, incarnation)

    def _admission(self, ref: ChildRef, incarnation: int) -> asyncio.Task[None]:
        """The load of the current weights into ``incarnation`` of ``ref``: one at a time."""
        entry = self._admitting.get(ref.path)
        if entry is not None and entry[0] == incarnation and not entry[1].done():
            return entry[1]
        assert self.weights is not None
        task = asyncio.create_task(self._load_weights(ref, incarnation, self.weights),
                                   name=f"admit:{ref.path}#{incarnation}")
        task.add_done_callback(_admission_done)
        self._admitting[ref.path] = (incarnation, task)
        return task

    async def _load_weights(self, ref: ChildRef, incarnation: int, weights: Refit) -> None:
        await within(ref.actor.update_weights.remote(weights),
                     self.update_timeout_s, f"{ref.path}.update_weights")
        self._admitted[ref.path] = incarnation

    async def publish(self, weights: Refit) -> None:
        """Make every running engine serve ``weights`` (passed on as they are: each engine
        fetches the buckets itself); engines that are down load them on admission.  Returns
        once every reachable engine reports the version."""
        self.weights = weights
        running = await wait_for_any(self.refs, 0)

        async def push(ref: ChildRef) -> None:
            try:
                incarnation = ref.incarnation  # the child may be gone since it was running
                await within(ref.actor.update_weights.remote(weights),
                             self.update_timeout_s, f"{ref.path}.update_weights")
                self._admitted[ref.path] = incarnation
            except ENGINE_GONE as exc:
                log.warning("engine %s missed weights v%d: %s", ref.path, weights.version,
                            type(exc).__name__)
                self._admitted.pop(ref.path, None)

        await asyncio.gather(*(push(r) for r in running))


def engine_failed_at(exc: BaseException) -> float | None:
    """When the engine under a failed stream declared itself failed
    (:attr:`~erlay.actors.engine.api.EngineFailed.failed_at`), if it said so: ``exc`` is the
    error :class:`EngineBatcher` gave the rollout, whose cause is the engine's error as Ray
    raised it (a ``RayTaskError`` that holds the engine's own error as ``.cause``)."""
    cause = exc.__cause__
    cause = getattr(cause, "cause", cause)
    at = getattr(cause, "failed_at", None)
    return float(at) if isinstance(at, int | float) else None


class EngineBatcher:
    """Coalesces the generate calls of concurrent rollouts into one streaming call per engine.

    A rollout asks for a stream of its own chunks; the requests made in the same event-loop
    turn for the same engine travel together as one ``generate_many`` call, and the batcher
    hands each chunk to its rollout.  If the engine dies, every rollout in the call gets the
    error and resumes on its own (see :mod:`erlay.actors.job.rollout`): as soon as the
    engine's process exits where it is on this node (:mod:`erlay.actors.job.engine_exits`),
    else when Ray fails the call.
    """

    def __init__(self, idle_s: float = 60.0) -> None:
        self.idle_s = idle_s   # the longest silence of an engine's stream
        self.exits = EngineExits()
        self._pending: dict[str, tuple[ChildRef, list[tuple[dict[str, Any],
                                                            asyncio.Queue[Any]]]]] = {}
        self.calls = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def stream(self, engine: ChildRef, request: dict[str, Any]) -> Any:
        """Yield the TokenChunk dicts of ``request`` as ``engine`` produces them."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        entry = self._pending.get(engine.path)
        if entry is None:
            entry = self._pending[engine.path] = (engine, [])
            asyncio.get_running_loop().call_soon(self._flush, engine.path)
        entry[1].append((request, queue))
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.get("finished"):
                return

    def _flush(self, path: str) -> None:
        engine, waiting = self._pending.pop(path)
        task = asyncio.create_task(self._run(engine, waiting), name=f"generate-many:{path}")
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    async def _run(self, engine: ChildRef,
                   waiting: list[tuple[dict[str, Any], asyncio.Queue[Any]]]) -> None:
        queues = {request["request_id"]: queue for request, queue in waiting}
        self.calls += 1
        try:
            with self.exits.guard(engine) as exits:
                stream = engine.actor.generate_many.remote([request for request, _ in waiting])
                async with aclosing(stream_within(stream, self.idle_s,
                                                  f"{engine.path}.generate_many")) as items:
                    async for chunks in items:
                        exits.raise_if_exited()
                        for chunk in chunks:
                            queue = queues.get(chunk["request_id"])
                            if queue is not None:
                                queue.put_nowait(chunk)
                                if chunk.get("finished"):
                                    del queues[chunk["request_id"]]
        except BaseException as exc:  # every waiting rollout must hear of it
            if not isinstance(exc, Exception):
                for queue in queues.values():
                    queue.put_nowait(exc)
                raise
            # One fresh error per rollout: a shared exception object would collect every
            # rollout's traceback as each re-raises it.  Any failure of the call (the actor
            # died, or its method raised) fails the rollouts over to another engine.
            kind = ChildNotRunning if isinstance(exc, ENGINE_GONE) else EngineRequestFailed
            for queue in queues.values():
                error = kind(f"{engine.path} failed under the stream: "
                             f"{type(exc).__name__}: {exc}"[:500])
                error.__cause__ = exc   # the engine's own error, and its failed_at if any
                queue.put_nowait(error)
            return
        for queue in queues.values():  # the stream ended without finishing them
            queue.put_nowait(ChildNotRunning(f"{engine.path} ended the stream early"))


# A tool call's host died (the actor is gone) or froze (no answer by the deadline) while the
# call was in it: what a tool call that kills its sandbox would do.
DIED_UNDER_CALL = (RayActorError, CallDeadlineExceeded)


def _result(key: str, outcome: str, detail: str) -> dict[str, Any]:
    """A SandboxResult dict for a run the client decided about without a result."""
    return {"key": key, "outcome": outcome, "exit_code": None, "signal": None,
            "stdout": "", "stderr": "", "stdout_truncated": False, "stderr_truncated": False,
            "wall_s": 0.0, "isolation": "none", "detail": detail}


class SandboxClient:
    """Runs tool calls on the sandbox workers of every node's sandbox host.

    Poison: a tool call whose host died or froze under it twice is not run again; its result
    is outcome ``poison`` (the environment observes a failed tool call), and ``poisoned``
    counts such calls.  Every call in flight on a host that dies shares that death, so an
    innocent call that was on the same host as a poison one both times is called poison too;
    that takes two deaths in a row on the same host, each already a restart."""

    def __init__(self, tree: SupervisionTree, hosts: list[str], workers: list[str],
                 max_attempts: int, call_timeout_s: float = 60.0,
                 limits: CallLimits | None = None) -> None:
        self.hosts = [tree.ref(p) for p in hosts]
        # With the goodput controller: each run's wall deadline (the request's timeout_s)
        # and a slot under its host's concurrency limit.  None: the sandbox limits' own.
        self.limits = limits
        self.workers = workers
        self.max_attempts = max_attempts
        self.call_timeout_s = call_timeout_s
        self.calls = 0
        self.poisoned = 0
        self._next = itertools.count()

    async def execute(self, key: str, code: str,
                      trace: dict[str, str] | None = None) -> dict[str, Any]:
        """The sandbox result dict for ``code`` (see sandbox.SandboxResult).  After
        ``max_attempts`` infrastructure failures, a synthetic ``spawn_failed`` result; after
        two deaths of its host under it, a ``poison`` one.  ``trace`` is the caller's trace
        context, for the host's span."""
        request = {"key": key, "code": code, "stdin": "", "timeout_s": None}
        last = ""
        deaths = 0
        for _ in range(self.max_attempts):
            hosts = await wait_for_any(self.hosts, 60.0)
            if not hosts:
                last = "no sandbox host is running"
                continue
            n = next(self._next)
            host = hosts[n % len(hosts)]
            worker = self.workers[(n // len(hosts)) % len(self.workers)]
            try:
                self.calls += 1
                result = await self._call(host, worker, request, trace)
                if result.get("outcome") != "spawn_failed":
                    return result  # type: ignore[no-any-return]
                # The sandbox could not start the run: not the code's fault, try again.
                last = str(result.get("detail") or "spawn failed")
                continue
            except (*CHILD_GONE, RayTaskError) as exc:
                last = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                log.warning("tool call %s failed on %s/%s: %s", key, host.path, worker, last)
                deaths += isinstance(exc, DIED_UNDER_CALL) \
                    and not isinstance(exc, ActorUnavailableError)
                if deaths >= 2:
                    self.poisoned += 1
                    return _result(key, "poison", f"its sandbox host died under it twice "
                                   f"(last: {last}); not run again")
                await asyncio.sleep(0.05)
        return _result(key, "spawn_failed",
                       f"sandbox unavailable after {self.max_attempts} attempts: {last}")

    async def _call(self, host: ChildRef, worker: str, request: dict[str, Any],
                    trace: dict[str, str] | None) -> dict[str, Any]:
        if self.limits is None:
            return await within(  # type: ignore[no-any-return]
                host.actor.call.remote(worker, "execute", (request,),
                                       {"trace": trace} if trace else None),
                self.call_timeout_s, f"{host.path}/{worker}.execute")
        async with self.limits.slot(host.path):
            deadline = self.limits.deadline()
            request = {**request, "timeout_s": deadline}
            started = time.monotonic()
            result: dict[str, Any] = await within(
                host.actor.call.remote(worker, "execute", (request,),
                                       {"trace": trace} if trace else None),
                self.call_timeout_s, f"{host.path}/{worker}.execute")
        if result.get("outcome") != "spawn_failed":
            ran = float(result.get("wall_s") or 0.0)
            # Waited at the host (its workers busy) longer than a run may take: congested.
            self.limits.record(host.path, ran, timed_out=result.get("outcome") == "timeout",
                               congested=time.monotonic() - started - ran > deadline)
        return result

"""Clients the rollout coordinator uses to reach the other fault domains.

Each client follows its children across restarts through the supervision tree (a
:class:`~erlay.supervisor.tree.ChildRef` per child) and turns a child's failure into a retry, a
failover or a marked result, never a crash of the coordinator:

- :class:`EnginePool` picks the least-loaded running engine and *admits* a new incarnation
  only after it has loaded the current weights.
- :class:`SandboxClient` runs a tool call under its idempotency key on a sandbox worker,
  retrying on another worker (or the restarted one) when the worker or its host dies.
- :class:`JudgeClient` scores within a retry budget behind a circuit breaker; past the
  budget the sample is marked with the reason.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from erlay.supervisor.errors import ChildNotRunning
from erlay.supervisor.tree import ChildRef, SupervisionTree

log = logging.getLogger("erlay.rollout")

class EngineRequestFailed(ChildNotRunning):
    """A live engine failed a streamed request (its method raised): fail over, but do not
    count the engine as dead."""


# A child that is restarting, or whose actor died under the call.
CHILD_GONE = (ChildNotRunning, RayActorError, KeyError)


async def _wait_for_any(refs: list[ChildRef], timeout_s: float) -> list[ChildRef]:
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


@dataclass
class Weights:
    version: int
    ref: Any  # ObjectRef of the numpy state dict


class EnginePool:
    """The generation engines, with admission of new incarnations."""

    def __init__(self, tree: SupervisionTree, paths: list[str]) -> None:
        self.refs = [tree.ref(p) for p in paths]
        self.weights: Weights | None = None
        self._admitted: dict[str, int] = {}
        self._load: dict[str, int] = {p: 0 for p in paths}
        self._admitting: dict[str, asyncio.Task[None]] = {}

    async def acquire(self, timeout_s: float = 120.0,
                      exclude: frozenset[tuple[str, int]] = frozenset()) -> ChildRef:
        """A running, admitted engine with the fewest requests in flight.

        ``exclude`` holds (path, incarnation) pairs that already failed the caller: an
        engine that just died looks running until its supervisor notices, and a failover
        must not land on it again."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = await _wait_for_any(self.refs, max(0.0, deadline - time.monotonic()))
            admitted = []
            for ref in running:
                try:
                    if (ref.path, ref.incarnation) in exclude:
                        continue
                except CHILD_GONE:
                    continue
                try:
                    if await self._admit(ref):
                        admitted.append(ref)
                except CHILD_GONE:
                    continue
            if admitted:
                ref = min(admitted, key=lambda r: self._load[r.path])
                self._load[ref.path] += 1
                return ref
            if time.monotonic() > deadline:
                raise ChildNotRunning("no generation engine is running")
            await asyncio.sleep(0.05)

    def release(self, ref: ChildRef) -> None:
        self._load[ref.path] = max(0, self._load[ref.path] - 1)

    async def _admit(self, ref: ChildRef) -> bool:
        """Load the current weights into a new incarnation before it serves."""
        incarnation = ref.incarnation
        if self._admitted.get(ref.path) == incarnation:
            return True
        if self.weights is None:
            self._admitted[ref.path] = incarnation
            return True
        task = self._admitting.get(ref.path)
        if task is None or task.done():
            task = self._admitting[ref.path] = asyncio.create_task(
                self._load_weights(ref, incarnation, self.weights))
        await task
        return self._admitted.get(ref.path) == incarnation

    async def _load_weights(self, ref: ChildRef, incarnation: int, weights: Weights) -> None:
        await ref.actor.update_weights.remote(weights.version, weights.ref)
        self._admitted[ref.path] = incarnation

    async def publish(self, weights: Weights) -> None:
        """Make every running engine serve ``weights``; engines that are down load them on
        admission.  Returns once every reachable engine reports the version."""
        self.weights = weights
        running = await _wait_for_any(self.refs, 0)

        async def push(ref: ChildRef) -> None:
            incarnation = ref.incarnation
            try:
                await ref.actor.update_weights.remote(weights.version, weights.ref)
                self._admitted[ref.path] = incarnation
            except CHILD_GONE as exc:
                log.warning("engine %s missed weights v%d: %s", ref.path, weights.version,
                            type(exc).__name__)
                self._admitted.pop(ref.path, None)

        await asyncio.gather(*(push(r) for r in running))


class EngineBatcher:
    """Coalesces the generate calls of concurrent rollouts into one streaming call per engine.

    A rollout asks for a stream of its own chunks; the requests made in the same event-loop
    turn for the same engine travel together as one ``generate_many`` call, and the batcher
    hands each chunk to its rollout.  If the engine dies, every rollout in the call gets the
    error and resumes on its own (see :mod:`erlay.actors.job.rollout`).
    """

    def __init__(self) -> None:
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
            stream = engine.actor.generate_many.remote([request for request, _ in waiting])
            async for ref in stream:
                for chunk in await ref:
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
            kind = ChildNotRunning if isinstance(exc, RayActorError) else EngineRequestFailed
            for queue in queues.values():
                queue.put_nowait(kind(f"{engine.path} failed under the stream: "
                                      f"{type(exc).__name__}: {exc}"[:500]))
            return
        for queue in queues.values():  # the stream ended without finishing them
            queue.put_nowait(ChildNotRunning(f"{engine.path} ended the stream early"))


class SandboxClient:
    """Runs tool calls on the sandbox workers of every node's sandbox host."""

    def __init__(self, tree: SupervisionTree, hosts: list[str], workers: list[str],
                 max_attempts: int) -> None:
        self.hosts = [tree.ref(p) for p in hosts]
        self.workers = workers
        self.max_attempts = max_attempts
        self.calls = 0
        self._next = itertools.count()

    async def execute(self, key: str, code: str,
                      trace: dict[str, str] | None = None) -> dict[str, Any]:
        """The sandbox result dict for ``code`` (see sandbox.SandboxResult).  After
        ``max_attempts`` infrastructure failures, a synthetic ``spawn_failed`` result.
        ``trace`` is the caller's trace context, for the host's span."""
        request = {"key": key, "code": code, "stdin": "", "timeout_s": None}
        last = ""
        for _ in range(self.max_attempts):
            hosts = await _wait_for_any(self.hosts, 60.0)
            if not hosts:
                last = "no sandbox host is running"
                continue
            n = next(self._next)
            host = hosts[n % len(hosts)]
            worker = self.workers[(n // len(hosts)) % len(self.workers)]
            try:
                self.calls += 1
                return await host.actor.call.remote(worker, "execute", (request,),
                                                    {"trace": trace} if trace else None)
            except (*CHILD_GONE, RayTaskError) as exc:
                last = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                log.warning("tool call %s failed on %s/%s: %s", key, host.path, worker, last)
                await asyncio.sleep(0.05)
        return {"key": key, "outcome": "spawn_failed", "exit_code": None, "signal": None,
                "stdout": "", "stderr": "", "stdout_truncated": False,
                "stderr_truncated": False, "wall_s": 0.0, "isolation": "none",
                "detail": f"sandbox unavailable after {self.max_attempts} attempts: {last}"}


class JudgeClient:
    """Scores through the judge workers with a retry budget and a circuit breaker.

    Judgements requested in the same event-loop turn travel as one ``score_many`` call.
    """

    def __init__(self, tree: SupervisionTree, hosts: list[str], workers: list[str],
                 retries: int, clock: Callable[[], float] = time.monotonic) -> None:
        from erlay.judges.budget import CircuitBreaker
        self.hosts = [tree.ref(p) for p in hosts]
        self.workers = workers
        self.retries = retries
        self.breaker = CircuitBreaker()
        self.clock = clock
        self.failures = 0
        self.calls = 0
        self._next = itertools.count()
        self._waiting: list[tuple[tuple[Any, ...], asyncio.Future[dict[str, Any]]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def score(self, key: str, judge_input: str, answer: str,
                    trace: dict[str, str] | None = None) -> dict[str, Any]:
        """A Judgement dict; ``ok=False`` with the reason once the budget is spent.
        ``trace`` is the caller's trace context, for the judge host's span."""
        last = ""
        for _ in range(self.retries + 1):
            if not self.breaker.allow(self.clock()):
                last = "circuit open"
                await asyncio.sleep(0.1)
                continue
            try:
                result = await self._attempt((judge_input, answer, key, trace))
            except (*CHILD_GONE, RayTaskError) as exc:
                last = f"{type(exc).__name__}"
                self.breaker.record_failure(self.clock())
                continue
            if result.get("ok", False):
                self.breaker.record_success(self.clock())
                return result
            last = result.get("reason", "judge failed")
            self.breaker.record_failure(self.clock())
        self.failures += 1
        return {"reward": 0.0, "ok": False,
                "reason": f"judge failed after {self.retries + 1} attempt(s): {last}"}

    async def _attempt(self, item: tuple[Any, ...]) -> dict[str, Any]:
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        if not self._waiting:
            asyncio.get_running_loop().call_soon(self._flush)
        self._waiting.append((item, future))
        return await future

    def _flush(self) -> None:
        batch, self._waiting = self._waiting, []
        task = asyncio.create_task(self._send(batch), name="judge-score-many")
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[tuple[Any, ...],
                                            asyncio.Future[dict[str, Any]]]]) -> None:
        try:
            hosts = await _wait_for_any(self.hosts, 30.0)
            if not hosts:
                raise ChildNotRunning("no judge host is running")
            n = next(self._next)
            host = hosts[n % len(hosts)]
            worker = self.workers[(n // len(hosts)) % len(self.workers)]
            self.calls += 1
            results = await host.actor.call.remote(worker, "score_many",
                                                   ([item for item, _ in batch],))
        except BaseException as exc:  # each waiting judgement must hear of it
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)

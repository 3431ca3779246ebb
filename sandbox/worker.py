"""The sandbox worker: a hosted in-process child that executes sandbox requests.

It follows the in-process child contract of :mod:`erlay.supervisor.hosted`: it is built from
``limits`` and ``slot``, ``setup()`` probes the machine's isolation once, ``execute`` is its
call, ``stop()`` kills the runs in flight, and ``progress`` is read by hang detection.

Contracts of :meth:`SandboxWorker.execute`:

- Bad code never raises: it is a result (timeout, memory, killed, ...).  Only a malformed
  request raises, a :class:`~erlay.sandbox.results.MalformedMessage` (a ValueError) naming the
  field.  As for any hosted call, an exception crashes the worker (it is restarted by its
  host, with an empty cache): a malformed request is the caller's bug.
- Idempotency: a result is stored under its request's key in a bounded LRU cache, and a
  retried call with the same key returns the stored result without running the code again.
  Calls with the key of a run in flight wait for that run.  A run keeps going when its
  caller gives up (the call is cancelled or times out), so a retry finds its result.
  ``spawn_failed`` results are not stored: they say nothing about the code, and a retry may
  succeed.  A key reused with different code still gets the stored result, and a warning.
- One run at a time: the slot's uid, and so its RLIMIT_NPROC budget and every process
  running as it, belong to a single run.  Concurrent calls with different keys queue; a
  node runs as many sandboxes at once as its host has workers.
- Progress: while runs are in flight the worker holds work in phase ``tool_call`` (``work``
  is the running run's key); each run that ends counts as a tick.  The pool sizes the
  ``tool_call`` deadline from the limits' wall timeout (:mod:`erlay.sandbox.pool`), so a request
  whose ``timeout_s`` is longer than that needs a larger margin there.
- Fault injection: the ``sandbox.exec`` failpoint (:mod:`erlay.supervisor.failpoints`) sits in a run
  after it begins its ``tool_call`` phase and before its code is spawned.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import logging
from typing import Any

from erlay.sandbox.isolation import SandboxUnavailable, current_isolation
from erlay.sandbox.limits import SandboxLimits
from erlay.sandbox.results import Outcome, SandboxRequest, SandboxResult
from erlay.sandbox.runner import run_in_sandbox
from erlay.supervisor import telemetry
from erlay.supervisor.failpoints import afailpoint, failpoint
from erlay.supervisor.progress import Progress

log = logging.getLogger("erlay.sandbox")

PHASE = "tool_call"
# What failpoint sandbox.user_code runs in place of the tool code: a program that hangs
# until the run's wall deadline kills it, as model-written code stuck in a wait does.
HANGING_CODE = "import time\nwhile True:\n    time.sleep(1)\n"


def _fingerprint(request: SandboxRequest) -> str:
    # The deadline is not part of what the request asks: a retry of one key may carry
    # another (the goodput controller adapts it), and is still the same request.
    text = f"{request.code}\0{request.stdin}"
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def _log_failure(task: asyncio.Task[Any]) -> None:
    # Every caller may have given up on the run; its failure must still be seen.
    if not task.cancelled() and task.exception() is not None:
        log.error("sandbox run %s failed in the worker", task.get_name(),
                  exc_info=task.exception())


class SandboxWorker:
    """Executes sandbox requests for one worker slot, with idempotency by key."""

    def __init__(self, limits: dict[str, Any] | SandboxLimits | None = None, slot: int = 0,
                 cache_size: int = 4096) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
            raise ValueError(f"slot: expected an integer >= 0, got {slot!r}")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size: expected an integer >= 1, got {cache_size!r}")
        self.limits = (limits if isinstance(limits, SandboxLimits)
                       else SandboxLimits.model_validate(limits or {}))
        self.slot = slot
        self.cache_size = cache_size
        self.progress = Progress()
        self._cache: collections.OrderedDict[str, tuple[str, dict[str, Any]]] = \
            collections.OrderedDict()
        self._in_flight: dict[str, tuple[str, asyncio.Task[dict[str, Any]]]] = {}
        self._runs = 0
        self._cache_hits = 0
        self._joined = 0
        self._outcomes: collections.Counter[str] = collections.Counter()
        self._one_at_a_time = asyncio.Lock()

    async def setup(self) -> None:
        """Probe the isolation now, so the first call does not pay for it, and say which."""
        try:
            iso, python = current_isolation(self.limits, self.slot)
        except SandboxUnavailable as exc:
            # Not a start failure: runs report spawn_failed with the reason, and the host
            # stays up for the other domains' sake.
            log.error("sandbox slot %d cannot run code: %s", self.slot, exc)
            return
        log.info("sandbox slot %d: isolation %s, interpreter %s", self.slot, iso.label, python)

    async def execute(self, request: dict[str, Any],
                      trace: dict[str, str] | None = None) -> dict[str, Any]:
        """Run ``request`` (a SandboxRequest dict) once per key; the SandboxResult dict.
        ``trace``: the caller's trace context; the call is a ``sandbox.run`` span under it."""
        key = request.get("key") if isinstance(request, dict) else None
        with telemetry.span("sandbox.run", parent=trace, child_only=True, key=key,
                            slot=self.slot) as span:
            result = await self._execute(request)
            span.set_attribute("erlay.outcome", str(result.get("outcome")))
            return result

    async def _execute(self, request: dict[str, Any]) -> dict[str, Any]:
        req = SandboxRequest.from_dict(request)
        fingerprint = _fingerprint(req)
        cached = self._cache.get(req.key)
        if cached is not None:
            self._cache.move_to_end(req.key)
            self._cache_hits += 1
            self._check_same(req.key, cached[0], fingerprint)
            return dict(cached[1])
        in_flight = self._in_flight.get(req.key)
        if in_flight is None:
            task = asyncio.create_task(self._run(req, fingerprint), name=f"sandbox:{req.key}")
            task.add_done_callback(_log_failure)
            self._in_flight[req.key] = (fingerprint, task)
        else:
            self._cache_hits += 1
            self._joined += 1
            self._check_same(req.key, in_flight[0], fingerprint)
            task = in_flight[1]
        # shield: a caller that gives up does not kill a run another caller, or a retry,
        # is waiting for.
        return dict(await asyncio.shield(task))

    async def _run(self, req: SandboxRequest, fingerprint: str) -> dict[str, Any]:
        try:
            async with self._one_at_a_time:
                self.progress.begin(PHASE, work=req.key)
                if await afailpoint("sandbox.exec"):  # chaos: this run fails to start
                    result = SandboxResult(req.key, Outcome.SPAWN_FAILED, None, None, "", "",
                                           False, False, 0.0, "none",
                                           "failpoint sandbox.exec: the run did not start")
                else:
                    if failpoint("sandbox.user_code"):   # chaos: the tool code hangs
                        req = dataclasses.replace(req, code=HANGING_CODE)
                    result = await run_in_sandbox(req, self.limits, slot=self.slot)
        finally:
            del self._in_flight[req.key]
            self._progress_after_run()
        self._runs += 1
        self._outcomes[result.outcome.value] += 1
        data = result.to_dict()
        if result.outcome is not Outcome.SPAWN_FAILED:
            self._store(req.key, fingerprint, data)
        else:
            log.warning("sandbox run %s could not start: %s", req.key, result.detail)
        return data

    def _progress_after_run(self) -> None:
        if not self._in_flight:
            self.progress.end()
            return
        # Still holding work: a tick, and the next run in line (the lock is FIFO).
        self.progress.begin(PHASE, work=next(iter(self._in_flight)))

    def _store(self, key: str, fingerprint: str, data: dict[str, Any]) -> None:
        self._cache[key] = (fingerprint, data)
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    @staticmethod
    def _check_same(key: str, stored: str, fingerprint: str) -> None:
        if stored != fingerprint:
            log.warning("sandbox key %s reused for a different request; returning the result "
                        "stored under it", key)

    def cached_result(self, key: str) -> SandboxResult | None:
        """The stored result for ``key``, if any (does not count as a hit)."""
        cached = self._cache.get(key)
        return SandboxResult.from_dict(cached[1]) if cached is not None else None

    def stats(self) -> dict[str, Any]:
        """Counters: ``runs`` (runs started, spawn failures included), ``cache_hits``
        (calls answered without running: from the cache or by joining a run in flight),
        ``joined`` (the latter), ``outcomes`` by kind, ``cached`` and ``in_flight``."""
        return {"runs": self._runs, "cache_hits": self._cache_hits, "joined": self._joined,
                "outcomes": dict(self._outcomes), "cached": len(self._cache),
                "in_flight": len(self._in_flight), "slot": self.slot}

    async def stop(self) -> None:
        """Kill the runs in flight (their processes and scratch directories go with them)."""
        tasks = [task for _, task in self._in_flight.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

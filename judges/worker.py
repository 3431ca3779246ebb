"""The judge worker: a hosted in-process child that scores samples with one judge.

It lives in a judge host (see :mod:`erlay.supervisor.hosted` for the contract) and wraps a judge
built from an import path, adding what every judge needs in the judge fault domain:

- **A deadline per judgement.**  A judgement past ``timeout_s`` returns ``ok=False``
  "judge timeout" instead of raising, so a slow judge marks a sample rather than crashing
  the worker.  Sync judges run in a daemon thread (see :mod:`erlay.judges.deadline`) so the host's
  event loop keeps serving; async judges are awaited under the same deadline.
- **Progress.**  ``progress`` is in phase ``judge_call`` while any judgement is in flight
  and ticks as each one finishes, so the supervisor's hang detection sees a worker whose
  judgements stop finishing (for instance one frozen in C code that holds the GIL).
- **Reuse of decided judgements.**  A small LRU cache by the caller's idempotency ``key``
  answers a retried judgement without judging again.  Only decided (``ok=True``) verdicts
  are cached: a retry after a timeout or an error must really try again.

Calls never raise for anything the judge does; an exception the judge lets escape becomes
``ok=False`` with the reason, because restarting the worker would not change the verdict.
The ``judge.score`` failpoint (:mod:`erlay.supervisor.failpoints`) stands for a fault of the worker
itself, so it sits outside that net: a ``raise`` there crashes the worker (its host restarts
it) and a ``hang`` holds the ``judge_call`` phase without ticks until hang detection acts.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from typing import Any

from erlay.judges.base import JUDGE_TIMEOUT, Judgement, load_judge
from erlay.judges.deadline import run_in_thread
from erlay.supervisor import telemetry
from erlay.supervisor.failpoints import afailpoint, failpoint
from erlay.supervisor.progress import Progress

log = logging.getLogger("erlay.judges")


def _fingerprint(judge_input: str, answer: str) -> str:
    return hashlib.sha256(repr((judge_input, answer)).encode()).hexdigest()


class JudgeWorker:
    """Scores with the judge at ``judge`` (``"module:Class"``) built with ``judge_kwargs``.

    ``timeout_s`` bounds one judgement; ``cache_size`` bounds the reuse cache (0 disables
    it).  Construction raises what :func:`erlay.judges.base.load_judge` raises: a bad judge is a
    start failure of the child.
    """

    def __init__(self, judge: str = "erlay.judges.math:MathJudge",
                 judge_kwargs: dict[str, Any] | None = None, timeout_s: float = 5.0,
                 cache_size: int = 1024) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a number > 0, got {timeout_s!r}")
        if cache_size < 0:
            raise ValueError(f"cache_size: expected an int >= 0, got {cache_size!r}")
        self.judge = load_judge(judge, **(judge_kwargs or {}))
        self.judge_path = judge
        self.timeout_s = float(timeout_s)
        self.cache_size = cache_size
        self.progress = Progress()
        self._cache: OrderedDict[str, tuple[str, Judgement]] = OrderedDict()
        self._in_flight = 0
        self.counts = {"calls": 0, "cache_hits": 0, "timeouts": 0, "errors": 0}

    async def score(self, judge_input: str, answer: str, key: str,
                    trace: dict[str, str] | None = None) -> dict[str, Any]:
        """``Judgement.to_dict()`` for ``judge_input`` against ``answer``.

        ``key`` is the caller's idempotency key: a decided judgement under the same key and
        the same inputs is returned from the cache.  Never raises for the judge's failures.
        ``trace``: the caller's trace context; the call is a ``judge.score`` span under it.
        """
        with telemetry.span("judge.score", parent=trace, child_only=True, key=key) as span:
            result = await self._score(judge_input, answer, key)
            span.set_attribute("erlay.ok", bool(result.get("ok", False)))
            return result

    async def _score(self, judge_input: str, answer: str, key: str) -> dict[str, Any]:
        self.counts["calls"] += 1
        fingerprint = _fingerprint(judge_input, answer)
        cached = self._cache.get(key)
        if cached is not None and cached[0] == fingerprint:
            self._cache.move_to_end(key)
            self.counts["cache_hits"] += 1
            return cached[1].to_dict()
        if cached is not None:
            log.warning("judge key %s reused for different inputs; judging again", key)
        self._enter(key)
        try:
            await afailpoint("judge.score")
            judgement = await self._judge(judge_input, answer, key)
        finally:
            self._leave()
        if judgement.ok and self.cache_size:
            self._cache[key] = (fingerprint, judgement)
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return judgement.to_dict()

    async def score_many(self, items: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
        """:meth:`score` for each ``(judge_input, answer, key[, trace])``, in order, in one
        call.

        Callers batch the judgements of concurrent rollouts so one Ray call carries many.
        The items are judged concurrently, each under its own deadline: one that hangs times
        out alone, and the batch takes as long as its slowest item, not their sum.  Each
        keeps its own cache entry and never-raise contract.
        """
        return list(await asyncio.gather(*(self.score(*item) for item in items)))

    async def _judge(self, judge_input: str, answer: str, key: str) -> Judgement:
        score_async = getattr(self.judge, "score_async", None)
        try:
            if callable(score_async):
                pending = _user_async(score_async, judge_input, answer, key)
            else:
                pending = run_in_thread(_user_sync, self.judge.score, judge_input, answer,  # type: ignore[union-attr]
                                        key, name=f"erlay-judge:{key}")
            result = await asyncio.wait_for(pending, self.timeout_s)
        except TimeoutError:
            self.counts["timeouts"] += 1
            log.warning("judgement %s exceeded %g s", key, self.timeout_s)
            return Judgement.undecided(f"{JUDGE_TIMEOUT}: {self.judge_path}.score gave no "
                                       f"answer within {self.timeout_s:g} s", "timeout")
        except Exception as exc:  # the worker's top level: mark, log, go on
            self.counts["errors"] += 1
            log.warning("judge %s failed on %s: %s: %s", self.judge_path, key,
                        type(exc).__name__, exc, exc_info=True)
            text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            return Judgement.undecided(f"judge error: {self.judge_path}.score raised {text}",
                                       "exception")
        if await afailpoint("judge.verdict"):  # chaos: the judge answers garbage
            result = {"reward": float("nan"), "garbage": True}
        if isinstance(result, Judgement):
            return result
        self.counts["errors"] += 1
        return Judgement.undecided(f"judge error: {self.judge_path}.score returned "
                                   f"{type(result).__name__}, not a Judgement", "bad_return")

    def _enter(self, key: str) -> None:
        # One phase for the whole worker: it holds work while any judgement is in flight.
        if self._in_flight == 0:
            self.progress.begin("judge_call", work=key)
        else:
            self.progress.tick()
        self._in_flight += 1

    def _leave(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self.progress.end()
        else:
            self.progress.tick()

    def stats(self) -> dict[str, int]:
        """Counters since start: calls, cache hits, timeouts, errors, in flight, cached."""
        return {**self.counts, "in_flight": self._in_flight, "cached": len(self._cache)}


_GARBAGE = object()  # what a judge returns when chaos corrupts it (a bad return)


def _user_sync(score: Any, judge_input: str, answer: str, key: str) -> Any:
    """The judge's own code, behind the ``judge.user_code`` failpoint (chaos plays the
    user's raise, hang or bad return here)."""
    if failpoint("judge.user_code"):
        return _GARBAGE
    return score(judge_input, answer, key=key)


async def _user_async(score_async: Any, judge_input: str, answer: str, key: str) -> Any:
    if await afailpoint("judge.user_code"):
        return _GARBAGE
    return await score_async(judge_input, answer, key=key)

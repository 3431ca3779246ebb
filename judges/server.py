"""The judge's side of its worker processes: the object a judge host's workers serve.

Each worker process of a judge host (:mod:`erlay.supervisor.worker_process`) builds the
configured judge once and scores one judgement at a time.  The host owns the deadline: a
judgement that freezes its process (sympy in C code holding the GIL, a deadlock, a blocked
read) costs that call and that worker process, which is replaced; the other workers of the
host keep judging.  Here, inside the process:

- **The judge's own failures are values.**  An exception the judge lets escape is
  ``Judgement.undecided(kind="exception")``; a value that is not a :class:`Judgement` (a
  NaN reward included) is ``kind="bad_return"``.  Retrying either would fail the same way,
  so callers do not (:class:`~erlay.actors.job.domains.JudgeClient`).
- **Reuse of decided judgements.**  A small LRU cache by the caller's idempotency ``key``
  answers a judgement asked again (its caller gave up waiting, a retry after a lost host)
  without judging again.  Only decided (``ok=True``) verdicts are cached, and only for the
  same inputs.  The cache lives as long as the process.
- **Failpoints.**  ``judge.user_code`` stands in the user's code (chaos plays its raise, hang,
  freeze or bad return there, inside the net).  ``judge.score`` stands for a fault of the
  worker itself, outside the net: a ``raise`` there escapes, which the host treats as a
  crash of the worker (restarted; the judgement is retried elsewhere).  ``judge.verdict``
  corrupts the verdict (a bad return).

This module runs inside worker processes: it imports the judge, never Ray.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import OrderedDict
from typing import Any

from erlay.judges.base import Judgement, load_judge
from erlay.supervisor import telemetry
from erlay.supervisor.failpoints import failpoint

log = logging.getLogger("erlay.judges")


def _fingerprint(judge_input: str, answer: str, prompt: str) -> str:
    return hashlib.sha256(repr((judge_input, answer, prompt)).encode()).hexdigest()


_GARBAGE = object()  # what a judge returns when chaos corrupts it (a bad return)


class JudgeServer:
    """Scores with the judge at ``judge`` (``"module:Class"``) built with ``judge_kwargs``.

    ``cache_size`` bounds the reuse cache (0 disables it).  Construction raises what
    :func:`erlay.judges.base.load_judge` raises: a bad judge is a start failure of the
    worker (``erlay run``'s preflight finds it before anything starts)."""

    def __init__(self, judge: str = "erlay.judges.math:MathJudge",
                 judge_kwargs: dict[str, Any] | None = None, cache_size: int = 1024) -> None:
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0:
            raise ValueError(f"cache_size: expected an int >= 0, got {cache_size!r}")
        self.judge = load_judge(judge, **(judge_kwargs or {}))
        self.judge_path = judge
        self.cache_size = cache_size
        self._cache: OrderedDict[str, tuple[str, Judgement]] = OrderedDict()
        self.counts = {"calls": 0, "cache_hits": 0, "errors": 0}

    async def score(self, judge_input: str, answer: str, key: str,
                    trace: dict[str, str] | None = None, *, prompt: str = "") -> Judgement:
        """The :class:`Judgement` of ``judge_input`` against ``answer``.  Never raises for
        the judge's failures.  ``key`` is the caller's idempotency key; ``trace`` its trace
        context (the call is a ``judge.score`` span under it); ``prompt`` the episode's
        prompt.  The judge gets ``key`` and ``prompt`` in its ``context``."""
        with telemetry.span("judge.score", parent=trace, child_only=True, key=key) as span:
            judgement = await self._score(judge_input, answer, key, prompt)
            span.set_attribute("erlay.ok", judgement.ok)
            return judgement

    async def _score(self, judge_input: str, answer: str, key: str, prompt: str) -> Judgement:
        self.counts["calls"] += 1
        fingerprint = _fingerprint(judge_input, answer, prompt)
        cached = self._cache.get(key)
        if cached is not None and cached[0] == fingerprint:
            self._cache.move_to_end(key)
            self.counts["cache_hits"] += 1
            return cached[1]
        if cached is not None:
            log.warning("judge key %s reused for different inputs; judging again", key)
        failpoint("judge.score")   # a fault of the worker, not of the user's code
        judgement = await self._judge(judge_input, answer, key, prompt)
        if judgement.ok and self.cache_size:
            self._cache[key] = (fingerprint, judgement)
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return judgement

    async def _judge(self, judge_input: str, answer: str, key: str, prompt: str) -> Judgement:
        try:
            result = await self._user_code(judge_input, answer, key, prompt)
        except Exception as exc:
            self.counts["errors"] += 1
            log.warning("judge %s failed on %s: %s: %s", self.judge_path, key,
                        type(exc).__name__, exc, exc_info=True)
            text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            return Judgement.undecided(f"judge error: {self.judge_path}.score raised {text}",
                                       "exception")
        if failpoint("judge.verdict"):  # chaos: the judge answers garbage
            result = _GARBAGE
        if isinstance(result, Judgement) and math.isfinite(result.reward):
            return result
        self.counts["errors"] += 1
        return Judgement.undecided(f"judge error: {self.judge_path}.score returned "
                                   f"{type(result).__name__}, not a Judgement", "bad_return")

    async def _user_code(self, judge_input: str, answer: str, key: str, prompt: str) -> Any:
        """The judge's own code, behind the ``judge.user_code`` failpoint."""
        if failpoint("judge.user_code"):
            return _GARBAGE
        score_async = getattr(self.judge, "score_async", None)
        if callable(score_async):
            return await score_async(judge_input, answer, key=key, prompt=prompt)
        return self.judge.score(judge_input, answer, key=key,  # type: ignore[union-attr]
                                prompt=prompt)

    def stats(self) -> dict[str, int]:
        """Counters since the process started: calls, cache hits, errors, cached."""
        return {**self.counts, "cached": len(self._cache)}

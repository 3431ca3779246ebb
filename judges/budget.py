"""Retry budget and circuit breaker for judge calls: decisions on injected time, no I/O.

The judge domain's rule: a failed judgement is retried within its budget; past the budget the
sample is *marked* (``ok=False`` with the reason), never silently zeroed.  When a judge
worker fails persistently, its :class:`CircuitBreaker` stops sending it work for a
cool-down, so a dead worker costs one quick refusal instead of a retry budget of timeouts,
while the other workers keep judging.  Callers keep one breaker per worker.

A breaker opens on the observed error rate, not on a few unlucky calls: over its last
``window`` calls (once it has seen ``min_calls``) more than ``open_rate`` of them failed, or
``failure_threshold`` failed in a row.  A judge that fails 15% of calls at random trips
neither (10 failures in a row at 15% has odds below 1e-8), so its healthy calls keep going.

States, and the only transitions (``now`` is the caller's clock, in seconds)::

    CLOSED    --the error rate or the run of failures passes its threshold-->  OPEN
    OPEN      --cool_down_s elapsed (read on any call)-->                      HALF_OPEN
    HALF_OPEN --the probe succeeds-->                                          CLOSED
    HALF_OPEN --the probe fails-->                                  OPEN (cool-down again)

In HALF_OPEN one call at a time is admitted as a probe.  A probe whose outcome is never
recorded (its caller was cancelled) expires after ``cool_down_s`` and another is admitted,
so the breaker cannot wedge half-open.  Outcomes recorded while OPEN come from calls
admitted before it opened and are ignored.  Closing clears the window.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from erlay.judges.base import Judgement

log = logging.getLogger("erlay.judges")


class BreakerState(enum.StrEnum):
    CLOSED = "closed"        # calls go through
    OPEN = "open"            # calls are refused until the cool-down ends
    HALF_OPEN = "half_open"  # one probe call at a time goes through


class CircuitBreaker:
    """A closed/open/half-open breaker over the error rate and runs of failures, on
    injected time."""

    def __init__(self, failure_threshold: int = 10, cool_down_s: float = 5.0, *,
                 window: int = 20, min_calls: int = 10, open_rate: float = 0.5) -> None:
        if not isinstance(failure_threshold, int) or failure_threshold < 1:
            raise ValueError(f"failure_threshold: expected an int >= 1, got "
                             f"{failure_threshold!r}")
        if not cool_down_s > 0:
            raise ValueError(f"cool_down_s: expected a number > 0, got {cool_down_s!r}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window: expected an int >= 1, got {window!r}")
        if not isinstance(min_calls, int) or not 1 <= min_calls <= window:
            raise ValueError(f"min_calls: expected an int in [1, window], got {min_calls!r}")
        if not 0 < open_rate <= 1:
            raise ValueError(f"open_rate: expected a number in (0, 1], got {open_rate!r}")
        self.failure_threshold = failure_threshold
        self.cool_down_s = float(cool_down_s)
        self.window = window
        self.min_calls = min_calls
        self.open_rate = float(open_rate)
        self._state = BreakerState.CLOSED
        self._failures = 0                      # consecutive, while CLOSED
        self._outcomes: deque[bool] = deque(maxlen=window)   # True: failed
        self._opened_at = 0.0
        self._probe_at: float | None = None     # when the HALF_OPEN probe was admitted

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    @property
    def error_rate(self) -> float | None:
        """The failed share of the window, or None before ``min_calls`` calls."""
        if len(self._outcomes) < self.min_calls:
            return None
        return sum(self._outcomes) / len(self._outcomes)

    def state(self, now: float) -> BreakerState:
        """The state at ``now``: OPEN turns HALF_OPEN once the cool-down has elapsed."""
        if self._state is BreakerState.OPEN and now - self._opened_at >= self.cool_down_s:
            self._state = BreakerState.HALF_OPEN
            self._probe_at = None
        return self._state

    def allow(self, now: float) -> bool:
        """Whether a call may go out at ``now``; in HALF_OPEN, admitting it makes it the
        probe.  Every admitted call should end in :meth:`record_success` or
        :meth:`record_failure`."""
        match self.state(now):
            case BreakerState.CLOSED:
                return True
            case BreakerState.OPEN:
                return False
            case BreakerState.HALF_OPEN:
                if self._probe_at is not None and now - self._probe_at < self.cool_down_s:
                    return False
                self._probe_at = now
                return True

    def record_success(self, now: float) -> None:
        match self.state(now):
            case BreakerState.CLOSED:
                self._failures = 0
                self._outcomes.append(False)
            case BreakerState.OPEN:
                pass
            case BreakerState.HALF_OPEN:
                log.info("judge circuit closed: probe succeeded")
                self._state, self._failures, self._probe_at = BreakerState.CLOSED, 0, None
                self._outcomes.clear()

    def record_failure(self, now: float) -> None:
        match self.state(now):
            case BreakerState.CLOSED:
                self._failures += 1
                self._outcomes.append(True)
                rate = self.error_rate
                if self._failures >= self.failure_threshold:
                    log.warning("judge circuit opened after %d consecutive failures; "
                                "cool-down %g s", self._failures, self.cool_down_s)
                    self._open(now)
                elif rate is not None and rate > self.open_rate:
                    log.warning("judge circuit opened: %.0f%% of the last %d calls failed; "
                                "cool-down %g s", 100 * rate, len(self._outcomes),
                                self.cool_down_s)
                    self._open(now)
            case BreakerState.OPEN:
                pass
            case BreakerState.HALF_OPEN:
                log.warning("judge circuit re-opened: probe failed")
                self._open(now)

    def _open(self, now: float) -> None:
        self._state, self._opened_at, self._probe_at = BreakerState.OPEN, now, None
        self._failures = 0


@dataclass(frozen=True)
class RetryBudget:
    """At most ``attempts`` tries of one judgement, with exponential backoff between them."""

    attempts: int = 3
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"attempts: expected an int >= 1, got {self.attempts!r}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff_s and max_backoff_s must be >= 0")

    def delay_s(self, attempt: int) -> float:
        """The pause after failed attempt number ``attempt`` (1-based)."""
        return float(min(self.max_backoff_s, self.backoff_s * 2.0 ** (attempt - 1)))


JudgeCall = Callable[[], Awaitable[Judgement | Mapping[str, Any]]]


async def judge_with_retries(call: JudgeCall, *, budget: RetryBudget = RetryBudget(),
                             breaker: CircuitBreaker | None = None,
                             clock: Callable[[], float] = time.monotonic,
                             sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep
                             ) -> Judgement:
    """A decided judgement from ``call``, or a marked one once the budget is spent.

    ``call`` makes one attempt and returns a :class:`Judgement` or its dict.  An attempt
    fails when it raises (a worker died, a task failed) or returns ``ok=False``; it succeeds
    when it returns ``ok=True`` (a decided 0.0 too: a wrong answer is not retried).  Each
    outcome is recorded in ``breaker``.  Returns the first decided judgement, else
    ``ok=False`` with reason ``"judge failed after N attempts: <last cause>"``; when the
    breaker refuses before any attempt, ``"judge circuit open"``.  ``clock`` and ``sleep``
    are injected so tests run on fake time.  Cancellation propagates.
    """
    attempts = 0
    cause = ""
    while attempts < budget.attempts:
        if breaker is not None and not breaker.allow(clock()):
            if attempts == 0:
                return Judgement.undecided("judge circuit open")
            cause = f"circuit open; last: {cause}"
            break
        attempts += 1
        try:
            outcome = await call()
            judgement = outcome if isinstance(outcome, Judgement) \
                else Judgement.from_dict(outcome)
        except Exception as exc:  # noqa: BLE001 - every failure counts against the budget
            cause = f"{type(exc).__name__}: {exc}"
        else:
            if judgement.ok:
                if breaker is not None:
                    breaker.record_success(clock())
                return judgement
            cause = judgement.reason or "undecided"
        if breaker is not None:
            breaker.record_failure(clock())
        log.warning("judge attempt %d/%d failed: %s", attempts, budget.attempts, cause)
        if attempts < budget.attempts:
            await sleep(budget.delay_s(attempts))
    return Judgement.undecided(f"judge failed after {attempts} attempts: {cause}")

"""Circuit breaker transitions and the retry budget, on a fake clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from erlay.judges.base import Judgement
from erlay.judges.budget import BreakerState, CircuitBreaker, RetryBudget, judge_with_retries


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def opened(threshold: int = 3, cool_down_s: float = 10.0) -> CircuitBreaker:
    breaker = CircuitBreaker(failure_threshold=threshold, cool_down_s=cool_down_s)
    for _ in range(threshold):
        breaker.record_failure(0.0)
    return breaker


def test_breaker_stays_closed_below_the_threshold() -> None:
    breaker = CircuitBreaker(failure_threshold=3)
    breaker.record_failure(0.0)
    breaker.record_failure(0.0)
    assert breaker.state(0.0) is BreakerState.CLOSED and breaker.allow(0.0)


def test_success_resets_the_consecutive_failures() -> None:
    breaker = CircuitBreaker(failure_threshold=2)
    breaker.record_failure(0.0)
    breaker.record_success(0.0)
    breaker.record_failure(0.0)
    assert breaker.state(0.0) is BreakerState.CLOSED


def test_breaker_opens_at_the_threshold_and_refuses_calls() -> None:
    breaker = opened(threshold=3)
    assert breaker.state(1.0) is BreakerState.OPEN
    assert not breaker.allow(1.0)


def test_breaker_turns_half_open_after_the_cool_down() -> None:
    breaker = opened(cool_down_s=10.0)
    assert breaker.state(9.9) is BreakerState.OPEN
    assert breaker.state(10.0) is BreakerState.HALF_OPEN


def test_half_open_admits_one_probe_at_a_time() -> None:
    breaker = opened(cool_down_s=10.0)
    assert breaker.allow(10.0)
    assert not breaker.allow(10.5)


def test_successful_probe_closes_the_breaker() -> None:
    breaker = opened(cool_down_s=10.0)
    breaker.allow(10.0)
    breaker.record_success(10.1)
    assert breaker.state(10.1) is BreakerState.CLOSED and breaker.allow(10.1)


def test_failed_probe_reopens_for_a_new_cool_down() -> None:
    breaker = opened(cool_down_s=10.0)
    breaker.allow(10.0)
    breaker.record_failure(11.0)
    assert breaker.state(20.9) is BreakerState.OPEN
    assert breaker.state(21.0) is BreakerState.HALF_OPEN


def test_lost_probe_expires_and_another_is_admitted() -> None:
    breaker = opened(cool_down_s=10.0)
    assert breaker.allow(10.0)
    assert breaker.allow(20.0)


def test_late_success_while_open_does_not_close_the_breaker() -> None:
    breaker = opened(cool_down_s=10.0)
    breaker.record_success(1.0)
    assert breaker.state(1.0) is BreakerState.OPEN


def test_retry_budget_backs_off_exponentially_up_to_its_cap() -> None:
    budget = RetryBudget(attempts=5, backoff_s=0.1, max_backoff_s=0.3)
    assert [budget.delay_s(n) for n in (1, 2, 3)] == [0.1, 0.2, 0.3]


class Script:
    """Answers each attempt with the next scripted outcome (an exception is raised)."""

    def __init__(self, *outcomes: Any) -> None:
        self.outcomes = list(outcomes)
        self.calls = 0

    async def __call__(self) -> Any:
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def run(call: Script, **kwargs: Any) -> tuple[Judgement, list[float]]:
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)

    judgement = asyncio.run(judge_with_retries(call, sleep=sleep, clock=FakeClock(), **kwargs))
    return judgement, delays


def test_first_decided_judgement_is_returned_without_retrying() -> None:
    call = Script(Judgement(0.0, True, "wrong answer"))
    judgement, delays = run(call)
    assert judgement == Judgement(0.0, True, "wrong answer") and call.calls == 1 and not delays


def test_failures_are_retried_until_a_decided_judgement() -> None:
    call = Script(ConnectionError("worker died"), {"reward": 0.0, "ok": False,
                                                   "reason": "judge timeout"},
                  {"reward": 1.0, "ok": True, "reason": "correct"})
    judgement, delays = run(call, budget=RetryBudget(attempts=3, backoff_s=0.1))
    assert judgement == Judgement(1.0, True, "correct")
    assert delays == [0.1, 0.2]


def test_exhausted_budget_marks_the_sample_with_the_last_cause() -> None:
    call = Script(ConnectionError("a"), ConnectionError("b"),
                  Judgement(0.0, False, "judge timeout"))
    judgement, _ = run(call, budget=RetryBudget(attempts=3))
    assert judgement == Judgement(0.0, False, "judge failed after 3 attempts: judge timeout")


def test_open_breaker_marks_the_sample_without_calling() -> None:
    call = Script(Judgement(1.0, True, "correct"))
    judgement, _ = run(call, breaker=opened())
    assert judgement == Judgement(0.0, False, "judge circuit open") and call.calls == 0


def test_breaker_opening_mid_retries_stops_them() -> None:
    call = Script(ConnectionError("a"), ConnectionError("b"), ConnectionError("c"))
    breaker = CircuitBreaker(failure_threshold=2, cool_down_s=60.0)
    judgement, _ = run(call, budget=RetryBudget(attempts=3), breaker=breaker)
    assert call.calls == 2
    assert judgement.ok is False
    assert judgement.reason == "judge failed after 2 attempts: circuit open; last: " \
        "ConnectionError: b"


def test_retries_record_their_outcomes_in_the_breaker() -> None:
    breaker = CircuitBreaker(failure_threshold=5)
    run(Script(ConnectionError("a"), Judgement(1.0, True, "correct")), breaker=breaker)
    assert breaker.consecutive_failures == 0


@pytest.mark.parametrize("kwargs", [{"failure_threshold": 0}, {"cool_down_s": 0}])
def test_breaker_rejects_bad_parameters(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        CircuitBreaker(**kwargs)

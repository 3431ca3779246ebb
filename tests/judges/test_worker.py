"""JudgeWorker: deadline, reuse cache, progress, judges loaded by import path."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from erlay.judges.base import Judgement, load_judge
from erlay.judges.worker import JudgeWorker

CALLS: list[str] = []
RELEASE = threading.Event()


class CountingJudge:
    """Decides correct when input equals answer; counts its calls."""

    name = "counting"

    def score(self, judge_input: str, answer: str, **context: Any) -> Judgement:
        CALLS.append(judge_input)
        return Judgement(float(judge_input == answer), True, "counted")


class StuckJudge:
    name = "stuck"

    def score(self, judge_input: str, answer: str, **context: Any) -> Judgement:
        CALLS.append(judge_input)
        RELEASE.wait(10)
        return Judgement(1.0, True, "late")


class RaisingJudge:
    name = "raising"

    def score(self, judge_input: str, answer: str, **context: Any) -> Judgement:
        raise KeyError("boom")


class AsyncJudge:
    name = "async"

    async def score_async(self, judge_input: str, answer: str, **context: Any) -> Judgement:
        await asyncio.sleep(0)
        return Judgement(1.0, True, f"async {context['key']}")


class NotAJudge:
    pass


@pytest.fixture(autouse=True)
def _reset() -> Any:
    CALLS.clear()
    RELEASE.clear()
    yield
    RELEASE.set()


def worker(judge: str, **kwargs: Any) -> JudgeWorker:
    return JudgeWorker(f"tests.judges.test_worker:{judge}", None, **kwargs)


def test_default_worker_scores_with_the_math_judge() -> None:
    result = asyncio.run(JudgeWorker().score("$132$", "132", "r-1/judge"))
    assert result == {"reward": 1.0, "ok": True, "reason": "correct"}


def test_stuck_judge_times_out_as_an_undecided_judgement() -> None:
    result = asyncio.run(worker("StuckJudge", timeout_s=0.05).score("1", "1", "k"))
    assert result == {"reward": 0.0, "ok": False, "kind": "timeout",
                      "reason": "judge timeout: tests.judges.test_worker:StuckJudge.score gave "
                                "no answer within 0.05 s"}


def test_judge_exception_is_undecided_not_raised() -> None:
    result = asyncio.run(worker("RaisingJudge").score("1", "1", "k"))
    assert result["ok"] is False and result["kind"] == "exception"
    assert "RaisingJudge.score raised KeyError: 'boom'" in result["reason"]


def test_retried_judgement_is_served_from_the_cache() -> None:
    w = worker("CountingJudge")

    async def twice() -> list[dict[str, Any]]:
        return [await w.score("1", "1", "k"), await w.score("1", "1", "k")]

    first, second = asyncio.run(twice())
    assert first == second and CALLS == ["1"]
    assert w.stats()["cache_hits"] == 1


def test_timed_out_judgement_is_not_cached() -> None:
    w = worker("StuckJudge", timeout_s=0.05)

    async def twice() -> None:
        await w.score("1", "1", "k")
        await w.score("1", "1", "k")

    asyncio.run(twice())
    assert CALLS == ["1", "1"]


def test_same_key_with_different_inputs_is_judged_again() -> None:
    w = worker("CountingJudge")

    async def both() -> dict[str, Any]:
        await w.score("1", "1", "k")
        return await w.score("2", "1", "k")

    assert asyncio.run(both())["reward"] == 0.0
    assert CALLS == ["1", "2"]


def test_cache_evicts_the_least_recently_used_key() -> None:
    w = worker("CountingJudge", cache_size=2)

    async def run() -> None:
        for key in ("a", "b", "a", "c", "b"):
            await w.score(key, key, key)

    asyncio.run(run())
    assert CALLS == ["a", "b", "c", "b"]


def test_async_judge_is_awaited_with_the_key() -> None:
    result = asyncio.run(worker("AsyncJudge").score("1", "1", "r-7/judge"))
    assert result["reason"] == "async r-7/judge"


def test_progress_holds_judge_call_while_a_judgement_runs() -> None:
    w = worker("StuckJudge", timeout_s=5.0)

    async def observe() -> tuple[str | None, str | None]:
        task = asyncio.create_task(w.score("1", "1", "k"))
        await asyncio.sleep(0.05)
        during = w.progress.snapshot().phase
        RELEASE.set()
        await task
        return during, w.progress.snapshot().phase

    assert asyncio.run(observe()) == ("judge_call", None)


def test_worker_rejects_an_object_that_is_not_a_judge() -> None:
    with pytest.raises(TypeError, match="Judge interface"):
        worker("NotAJudge")


def test_load_judge_names_a_missing_module() -> None:
    with pytest.raises(ImportError, match=r"judges\.no_such"):
        load_judge("erlay.judges.no_such:Judge")


def test_judge_score_failpoint_raise_escapes_as_a_worker_fault() -> None:
    from erlay.supervisor import failpoints
    w = worker("CountingJudge")
    failpoints.arm("judge.score", "raise")
    try:
        with pytest.raises(failpoints.FailpointError):
            asyncio.run(w.score("1", "1", "k"))
    finally:
        failpoints.disarm_all()
    assert CALLS == [] and w.stats()["in_flight"] == 0
    assert asyncio.run(w.score("1", "1", "k"))["ok"] is True


def test_judge_verdict_failpoint_corrupts_one_verdict_which_is_marked_not_zeroed() -> None:
    from erlay.supervisor import failpoints
    w = worker("CountingJudge")
    failpoints.arm("judge.verdict", "corrupt", count=1)
    try:
        garbage = asyncio.run(w.score("1", "1", "k1"))
        after = asyncio.run(w.score("1", "1", "k2"))
    finally:
        failpoints.disarm_all()
    assert garbage["ok"] is False and "not a Judgement" in garbage["reason"]
    assert garbage["kind"] == "bad_return"
    assert after["ok"] is True  # count=1: only one verdict was corrupted


def test_judge_user_code_failpoint_plays_the_judges_own_failures() -> None:
    """Chaos's user_error on a judge: raise, hang and bad return, each typed."""
    from erlay.supervisor import failpoints
    outcomes = {}
    for action, kind in (("raise", "exception"), ("corrupt", "bad_return"),
                         ("hang", "timeout")):
        failpoints.arm("judge.user_code", action, count=1)
        try:
            outcomes[action] = asyncio.run(worker("CountingJudge", timeout_s=0.2)
                                           .score("1", "1", f"k-{action}"))
        finally:
            failpoints.disarm_all()
        assert outcomes[action]["ok"] is False and outcomes[action]["kind"] == kind

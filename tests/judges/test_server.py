"""JudgeServer, inside a judge worker process: the judge's own failures as values, the
reuse cache, judges loaded by import path, the failpoints.  In this process: the deadline
and the worker process are the host's (test_client.py runs them)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from erlay.judges.base import Judgement, load_judge
from erlay.judges.server import JudgeServer

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


class NoneJudge:
    name = "none"

    def score(self, judge_input: str, answer: str, **context: Any) -> Any:
        return None


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


def server(judge: str, **kwargs: Any) -> JudgeServer:
    return JudgeServer(f"tests.judges.test_server:{judge}", None, **kwargs)


def score(s: JudgeServer, judge_input: str, answer: str, key: str) -> Judgement:
    return asyncio.run(s.score(judge_input, answer, key))


def test_default_server_scores_with_the_math_judge() -> None:
    assert score(JudgeServer(), "$132$", "132", "r-1/judge") == Judgement(1.0, True, "correct")


def test_judge_exception_is_undecided_not_raised() -> None:
    result = score(server("RaisingJudge"), "1", "1", "k")
    assert result.ok is False and result.kind == "exception"
    assert "RaisingJudge.score raised KeyError: 'boom'" in result.reason


def test_a_value_that_is_not_a_judgement_is_a_bad_return() -> None:
    result = score(server("NoneJudge"), "1", "1", "k")
    assert result.ok is False and result.kind == "bad_return"
    assert "returned NoneType, not a Judgement" in result.reason


def test_retried_judgement_is_served_from_the_cache() -> None:
    s = server("CountingJudge")

    async def twice() -> list[Judgement]:
        return [await s.score("1", "1", "k"), await s.score("1", "1", "k")]

    first, second = asyncio.run(twice())
    assert first == second and CALLS == ["1"]
    assert s.stats()["cache_hits"] == 1


def test_an_undecided_judgement_is_not_cached() -> None:
    s = server("RaisingJudge")

    async def twice() -> None:
        await s.score("1", "1", "k")
        await s.score("1", "1", "k")

    asyncio.run(twice())
    assert s.stats()["cache_hits"] == 0 and s.stats()["errors"] == 2


def test_same_key_with_different_inputs_is_judged_again() -> None:
    s = server("CountingJudge")

    async def both() -> Judgement:
        await s.score("1", "1", "k")
        return await s.score("2", "1", "k")

    assert asyncio.run(both()).reward == 0.0
    assert CALLS == ["1", "2"]


def test_cache_evicts_the_least_recently_used_key() -> None:
    s = server("CountingJudge", cache_size=2)

    async def run() -> None:
        for key in ("a", "b", "a", "c", "b"):
            await s.score(key, key, key)

    asyncio.run(run())
    assert CALLS == ["a", "b", "c", "b"]


def test_async_judge_is_awaited_with_the_key() -> None:
    assert score(server("AsyncJudge"), "1", "1", "r-7/judge").reason == "async r-7/judge"


def test_server_rejects_an_object_that_is_not_a_judge() -> None:
    with pytest.raises(TypeError, match="Judge interface"):
        server("NotAJudge")


def test_load_judge_names_a_missing_module() -> None:
    with pytest.raises(ImportError, match=r"judges\.no_such"):
        load_judge("erlay.judges.no_such:Judge")


def test_judge_score_failpoint_raise_escapes_as_a_worker_fault() -> None:
    from erlay.supervisor import failpoints
    s = server("CountingJudge")
    failpoints.arm("judge.score", "raise")
    try:
        with pytest.raises(failpoints.FailpointError):
            score(s, "1", "1", "k")
    finally:
        failpoints.disarm_all()
    assert CALLS == []
    assert score(s, "1", "1", "k").ok is True


def test_judge_verdict_failpoint_corrupts_one_verdict_which_is_marked_not_zeroed() -> None:
    from erlay.supervisor import failpoints
    s = server("CountingJudge")
    failpoints.arm("judge.verdict", "corrupt", count=1)
    try:
        garbage = score(s, "1", "1", "k1")
        after = score(s, "1", "1", "k2")
    finally:
        failpoints.disarm_all()
    assert garbage.ok is False and "not a Judgement" in garbage.reason
    assert garbage.kind == "bad_return"
    assert after.ok is True  # count=1: only one verdict was corrupted


def test_judge_user_code_failpoint_plays_the_judges_own_raise_and_bad_return() -> None:
    """Chaos's user_error on a judge, inside the net: each typed.  (A hang or a freeze
    there is the host's deadline to end: test_client.py.)"""
    from erlay.supervisor import failpoints
    for action, kind in (("raise", "exception"), ("corrupt", "bad_return")):
        failpoints.arm("judge.user_code", action, count=1)
        try:
            outcome = score(server("CountingJudge"), "1", "1", f"k-{action}")
        finally:
            failpoints.disarm_all()
        assert outcome.ok is False and outcome.kind == kind

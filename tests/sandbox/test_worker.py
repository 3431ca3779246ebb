"""The sandbox worker: idempotency by key, malformed requests, progress and shutdown."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from erlay.sandbox.results import MalformedMessage, Outcome, SandboxRequest
from erlay.sandbox.worker import SandboxWorker
from tests.sandbox.conftest import LIMITS, SLOT, Spawned


def worker(**kwargs: Any) -> SandboxWorker:
    return SandboxWorker(kwargs.pop("limits", LIMITS), SLOT, **kwargs)


def request(key: str, code: str = "print('hi')", **kw: Any) -> dict[str, Any]:
    return SandboxRequest(key, code, **kw).to_dict()


def test_same_key_runs_once_and_returns_the_stored_result() -> None:
    w = worker()

    async def twice() -> tuple[dict[str, Any], dict[str, Any]]:
        code = "import random\nprint(random.random())"
        return await w.execute(request("r-1/tool-0", code)), \
            await w.execute(request("r-1/tool-0", code))

    first, second = asyncio.run(twice())
    assert first == second and first["outcome"] == "ok"
    assert w.stats()["runs"] == 1 and w.stats()["cache_hits"] == 1


def test_concurrent_calls_with_the_same_key_run_the_code_once() -> None:
    w = worker()

    async def together() -> tuple[dict[str, Any], ...]:
        req = request("r-2/tool-0", "import time, random\ntime.sleep(0.3)\nprint(random.random())")
        return await asyncio.gather(w.execute(req), w.execute(req), w.execute(req))

    results = asyncio.run(together())
    assert results[0] == results[1] == results[2]
    assert w.stats()["runs"] == 1
    assert w.stats()["joined"] == 2 and w.stats()["cache_hits"] == 2


def test_a_key_reused_for_other_code_returns_the_stored_result(
        caplog: pytest.LogCaptureFixture) -> None:
    w = worker()

    async def reuse() -> tuple[dict[str, Any], dict[str, Any]]:
        return await w.execute(request("r-8/tool-0", "print('first')")), \
            await w.execute(request("r-8/tool-0", "print('second')"))

    first, second = asyncio.run(reuse())
    assert first == second and first["stdout"] == "first\n" and w.stats()["runs"] == 1
    assert "reused for a different request" in caplog.text


def test_different_keys_run_separately() -> None:
    w = worker()

    async def both() -> None:
        await w.execute(request("a"))
        await w.execute(request("b"))

    asyncio.run(both())
    assert w.stats()["runs"] == 2 and w.stats()["cache_hits"] == 0


def test_runs_with_different_keys_take_turns_on_one_worker() -> None:
    w = worker()
    # CLOCK_MONOTONIC is shared with the sandboxes: each run reports when it ran.
    code = "import time\nstart = time.monotonic()\ntime.sleep(0.2)\nprint(start, time.monotonic())"

    async def together() -> tuple[dict[str, Any], ...]:
        return await asyncio.gather(w.execute(request("t-1", code)),
                                    w.execute(request("t-2", code)))

    (a_start, a_end), (b_start, b_end) = (map(float, r["stdout"].split())
                                          for r in asyncio.run(together()))
    assert a_end <= b_start or b_end <= a_start
    assert w.stats()["runs"] == 2


def test_bad_code_is_a_result_and_counted_by_outcome() -> None:
    w = worker()

    async def bad() -> dict[str, Any]:
        return await w.execute(request("bad", "raise SystemExit(4)"))

    result = asyncio.run(bad())
    assert result["outcome"] == "error" and result["exit_code"] == 4
    assert w.stats()["outcomes"] == {"error": 1}


@pytest.mark.parametrize(("data", "field"), [
    ({"code": "print(1)"}, "key"),
    ({"key": "k"}, "code"),
    ({"key": "", "code": "x"}, "key"),
    ({"key": "k", "code": 42}, "code"),
    ({"key": "k", "code": "x", "stdin": None}, "stdin"),
    ({"key": "k", "code": "x", "timeout_s": -1}, "timeout_s"),
    ({"key": "k", "code": "x", "timeout_s": True}, "timeout_s"),
    ({"key": "k", "code": "x", "timeout": 3}, "request.timeout"),
    (["k", "x"], "request"),
])
def test_malformed_request_raises_a_value_error_naming_the_field(data: Any, field: str) -> None:
    w = worker()
    with pytest.raises(MalformedMessage) as error:
        asyncio.run(w.execute(data))
    assert isinstance(error.value, ValueError) and error.value.field == field
    assert str(error.value).startswith(f"{field}: expected")
    assert w.stats()["runs"] == 0


def test_cache_is_bounded_and_evicts_the_least_recently_used() -> None:
    w = worker(cache_size=2)

    async def calls() -> None:
        for key in ("a", "b", "a", "c", "a", "b"):  # "b" is evicted by "c", then re-run
            await w.execute(request(key))

    asyncio.run(calls())
    assert w.stats()["runs"] == 4 and w.stats()["cache_hits"] == 2
    assert w.stats()["cached"] == 2


def test_progress_holds_tool_call_with_the_key_while_running() -> None:
    w = worker()

    async def observe() -> tuple[Any, Any]:
        call = asyncio.create_task(w.execute(request("r-3/tool-1", "import time\ntime.sleep(0.4)")))
        await asyncio.sleep(0.2)
        during = w.progress.snapshot()
        await call
        return during, w.progress.snapshot()

    during, after = asyncio.run(observe())
    assert (during.phase, during.work) == ("tool_call", "r-3/tool-1")
    assert (after.phase, after.work) == (None, None) and after.counter > during.counter


def test_a_caller_giving_up_does_not_lose_the_run() -> None:
    w = worker()

    async def give_up_then_retry() -> dict[str, Any]:
        req = request("r-4/tool-0", "import time\ntime.sleep(0.4)\nprint('finished')")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(w.execute(req), 0.1)
        return await w.execute(req)

    result = asyncio.run(give_up_then_retry())
    assert result["stdout"] == "finished\n" and w.stats()["runs"] == 1


def test_stop_kills_runs_in_flight(spawned: Spawned) -> None:
    w = worker()

    async def stop_midway() -> BaseException | dict[str, Any]:
        call = asyncio.create_task(w.execute(request("r-5/tool-0", "import time\ntime.sleep(30)")))
        await asyncio.sleep(0.3)
        await w.stop()
        return (await asyncio.gather(call, return_exceptions=True))[0]

    outcome = asyncio.run(stop_midway())
    assert isinstance(outcome, asyncio.CancelledError)
    assert w.stats()["in_flight"] == 0 and spawned.leftovers() == []


def test_spawn_failures_are_not_stored() -> None:
    w = worker(limits=LIMITS.model_copy(update={"python": "/nonexistent/python3"}))

    async def twice() -> list[dict[str, Any]]:
        return [await w.execute(request("r-6/tool-0")), await w.execute(request("r-6/tool-0"))]

    results = asyncio.run(twice())
    assert [r["outcome"] for r in results] == ["spawn_failed", "spawn_failed"]
    assert w.stats()["runs"] == 2 and w.stats()["cache_hits"] == 0


def test_cached_result_is_returned_as_a_typed_result() -> None:
    w = worker()
    asyncio.run(w.execute(request("r-7/tool-0")))
    stored = w.cached_result("r-7/tool-0")
    assert stored is not None and stored.outcome is Outcome.OK and stored.stdout == "hi\n"
    assert w.cached_result("unknown") is None


def test_worker_rejects_bad_construction_arguments() -> None:
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxWorker({"memory_mb": 1})
    with pytest.raises(ValueError, match="slot"):
        SandboxWorker(None, -1)
    with pytest.raises(ValueError, match="cache_size"):
        SandboxWorker(None, 0, cache_size=0)


def test_sandbox_exec_failpoint_raise_fails_the_call_before_any_code_runs() -> None:
    from erlay.supervisor import failpoints
    w = worker()
    failpoints.arm("sandbox.exec", "raise")
    try:
        with pytest.raises(failpoints.FailpointError):
            asyncio.run(w.execute(request("r-fp/tool-0")))
    finally:
        failpoints.disarm_all()
    assert w.stats()["runs"] == 0 and w.stats()["in_flight"] == 0
    assert asyncio.run(w.execute(request("r-fp/tool-0")))["outcome"] == "ok"

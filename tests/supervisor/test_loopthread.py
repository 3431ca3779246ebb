"""LoopThread: work on a loop of its own, awaited from another loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from erlay.supervisor.loopthread import LoopThread


def test_run_gives_the_value_computed_on_the_other_thread() -> None:
    lt = LoopThread("t")

    async def where() -> int | None:
        return threading.get_native_id()

    async def go() -> Any:
        return await lt.run(where())
    try:
        assert asyncio.run(go()) == lt.native_id != threading.get_native_id()
    finally:
        lt.close()


def test_run_raises_what_the_work_raised() -> None:
    lt = LoopThread("t")

    async def boom() -> None:
        raise KeyError("x")

    async def go() -> None:
        await lt.run(boom())
    try:
        with pytest.raises(KeyError):
            asyncio.run(go())
    finally:
        lt.close()


def test_cancelling_the_caller_cancels_the_work_and_waits_for_its_cleanup() -> None:
    lt = LoopThread("t")
    cleaned = threading.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.2)   # a cleanup that takes a while, on the work's loop
            cleaned.set()

    async def go() -> None:
        task = asyncio.ensure_future(lt.run(work()))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    try:
        asyncio.run(go())
        assert cleaned.is_set()   # done before the caller's cancellation returned
    finally:
        lt.close()


def test_concurrent_closes_stop_the_loop_once_and_none_waits_on_a_stopped_loop(
        caplog: pytest.LogCaptureFixture) -> None:
    """The coordinator's stop and its run's end both close its thread: a second close that
    scheduled its cleanup on a loop the first had stopped waited 15 s for nothing."""
    for _ in range(5):
        lt = LoopThread("t")
        closers = [threading.Thread(target=lt.close) for _ in range(8)]
        for t in closers:
            t.start()
        for t in closers:
            t.join(10)
        assert lt.loop.is_closed() and not any(t.is_alive() for t in closers)
    assert "did not finish cancelling" not in caplog.text

"""A stream bounded by :func:`stream_within`: silence past its deadline fails the call, and a
cancellation of the reading task is never lost, not even to an item arriving in its turn."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from erlay.supervisor.deadline import stream_within
from erlay.supervisor.errors import CallDeadlineExceeded


class Stream:
    """An async iterator whose items are the results of ``items``, in order."""

    def __init__(self, *items: asyncio.Future[Any]) -> None:
        self.items = list(items)

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        return await self.items.pop(0)


def test_a_cancellation_in_the_turn_an_item_arrives_still_cancels_the_reader() -> None:
    async def scenario() -> tuple[bool, list[Any]]:
        loop = asyncio.get_running_loop()
        first, never = loop.create_future(), loop.create_future()
        got: list[Any] = []

        async def read() -> None:
            async for item in stream_within(Stream(first, never), 30, "engine.generate"):
                got.append(item)

        reader = asyncio.create_task(read())
        await asyncio.sleep(0)   # the reader waits for its first item
        first.set_result("chunk")
        reader.cancel()          # the coordinator stops, in the same turn
        try:
            await asyncio.wait_for(reader, 5)
        except asyncio.CancelledError:
            pass
        return reader.cancelled(), got

    assert asyncio.run(scenario()) == (True, [])


def test_a_stream_silent_past_its_deadline_fails_the_call() -> None:
    async def scenario() -> None:
        never = asyncio.get_running_loop().create_future()
        async for _ in stream_within(Stream(never), 0.05, "engine.generate"):
            pass

    with pytest.raises(CallDeadlineExceeded, match=r"engine\.generate: silent for 0\.05 s"):
        asyncio.run(scenario())


def test_an_item_whose_value_never_comes_counts_as_silence() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        ref, value = loop.create_future(), loop.create_future()
        ref.set_result(value)   # a Ray stream yields an ObjectRef; its value comes later
        async for _ in stream_within(Stream(ref), 0.05, "engine.generate"):
            pass

    with pytest.raises(CallDeadlineExceeded, match="silent for"):
        asyncio.run(scenario())

"""A step's rollouts live and die together: when one fails, the others are cancelled and
awaited before the failure propagates, so none is left writing to the journal beside the
replay a restarted coordinator makes of them.  No Ray."""

from __future__ import annotations

import asyncio

import pytest

from erlay.actors.job.structured import all_or_none


def test_one_failing_rollout_cancels_and_awaits_its_siblings() -> None:
    wrote: list[str] = []
    ended: list[str] = []

    async def sibling(name: str) -> str:
        try:
            await asyncio.sleep(0.2)
            wrote.append(name)          # what an orphan would go on writing
            return name
        finally:
            ended.append(name)

    async def failing() -> str:
        await asyncio.sleep(0.01)
        raise RuntimeError("failpoint rollout.dispatch fired")

    async def main() -> None:
        with pytest.raises(RuntimeError, match="failpoint"):
            await all_or_none([sibling("a"), failing(), sibling("b")])
        assert sorted(ended) == ["a", "b"]   # both ended before the error came out
        await asyncio.sleep(0.3)
        assert wrote == []                   # and neither wrote afterwards

    asyncio.run(main())


def test_all_results_in_order_when_none_fails() -> None:
    async def value(v: int) -> int:
        await asyncio.sleep(0.01 * (3 - v))
        return v

    assert asyncio.run(all_or_none([value(0), value(1), value(2)])) == [0, 1, 2]

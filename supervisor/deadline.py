"""Deadlines on calls across fault domains: no ``await`` on another domain is unbounded.

A caller wraps every call to another domain's child in :func:`within` (one answer) or
:func:`stream_within` (a stream, bounded per item).  When the deadline passes the caller gets
:class:`~erlay.supervisor.errors.CallDeadlineExceeded` and treats the call as failed; whether
the callee is hung is for its own supervisor to decide (liveness heartbeat and progress
deadlines), so a slow answer never kills anything by itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from erlay.supervisor.errors import CallDeadlineExceeded

T = TypeVar("T")


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable


async def within(awaitable: Awaitable[T], timeout_s: float, what: str) -> T:
    """``await awaitable`` for at most ``timeout_s`` seconds; raise CallDeadlineExceeded
    naming ``what`` past it.  Works on coroutines, futures and Ray ObjectRefs."""
    try:
        return await asyncio.wait_for(_await(awaitable), timeout_s)
    except TimeoutError:
        raise CallDeadlineExceeded(f"{what}: no answer within {timeout_s:g} s") from None


async def stream_within(stream: Any, idle_s: float, what: str) -> AsyncIterator[Any]:
    """Iterate an async stream (a Ray streaming generator of ObjectRefs, or any async
    iterator), awaiting each item's value, with at most ``idle_s`` seconds of silence
    between items.

    A cancellation of the iterating task always propagates: the waits run in that task
    under ``asyncio.timeout``, not in ``asyncio.wait_for``, which on Python 3.11 returns an
    item that arrived in the turn of the cancellation and drops the cancellation."""
    iterator = stream.__aiter__()
    while True:
        try:
            async with asyncio.timeout(idle_s):
                item = await iterator.__anext__()
                if isinstance(item, Awaitable):
                    item = await item
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise CallDeadlineExceeded(f"{what}: silent for {idle_s:g} s") from None
        yield item

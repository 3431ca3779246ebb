"""Structured concurrency for the coordinator's coroutines: a group of them finishes or
fails together, and nothing is left running.

``asyncio.gather`` leaves the other awaitables running when one fails: a step's rollouts
orphaned after a sibling's failure would go on writing to the journal beside the replay that
the coordinator's successor makes of them.  Used by the coordinator and the validator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any


async def all_or_none(coros: Iterable[Awaitable[Any]]) -> list[Any]:
    """Await every one of ``coros`` concurrently; if one fails (or this is cancelled),
    cancel the rest and wait for them before raising."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await cancel_all(tasks)
        raise


async def cancel_all(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until they have ended (each one's error is its own)."""
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)

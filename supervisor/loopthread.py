"""An event loop in a thread of its own, for work that must not share a supervisor's loop.

A supervisor's loop runs supervision only: every decision, heartbeat judgement and restart of
the tree waits on it.  A child that does real work in the same process (the rollout
coordinator: tokenising, batching, journaling, publishing weights) runs that work on a
:class:`LoopThread`, and the supervisor awaits it through :meth:`LoopThread.run`, which costs
the supervisor's loop one callback when the work ends, however long the work took.

Contracts:

- :meth:`run` returns what the coroutine returned, or raises what it raised.  Cancelling the
  awaiting task cancels the coroutine on its own loop and waits, at most ``cancel_wait_s``,
  for it to finish cancelling (its ``finally`` blocks), so a successor never overlaps it.
- :meth:`close` cancels every task still on the loop, waits at most ``timeout_s`` for them,
  stops the loop and joins the thread; idempotent.  A task that ignores cancellation past the
  wait is left behind, with a warning (the thread is a daemon: it never blocks exit).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("erlay.supervisor")


class LoopThread:
    """A new event loop, running in a new daemon thread named ``name``."""

    def __init__(self, name: str, *, cancel_wait_s: float = 30.0) -> None:
        self.name = name
        self.cancel_wait_s = cancel_wait_s
        self.loop = asyncio.new_event_loop()
        self._closing = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this thread's loop and await its result from the caller's loop."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            done, _ = await asyncio.get_running_loop().run_in_executor(
                None, concurrent.futures.wait, [future], self.cancel_wait_s)
            if not done:
                log.warning("%s: the work did not finish cancelling within %g s", self.name,
                            self.cancel_wait_s)
            raise

    def close(self, timeout_s: float = 15.0) -> None:
        """Cancel what is left on the loop, stop it, join the thread (see the module
        docstring).  Must not be called from this thread."""
        with self._closing:   # one close at a time: a second waits for the first
            self._close(timeout_s)

    def _close(self, timeout_s: float) -> None:
        if self.loop.is_closed():
            return
        if self.loop.is_running():
            cancel = _cancel_all()
            try:
                asyncio.run_coroutine_threadsafe(cancel, self.loop).result(timeout_s)
            except Exception:  # noqa: BLE001 - best effort: the loop stops regardless
                cancel.close()   # never scheduled (the loop stopped meanwhile): no warning
                log.warning("%s: some tasks did not finish cancelling", self.name)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=timeout_s)
        if not self.loop.is_running():
            self.loop.close()


async def _cancel_all() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

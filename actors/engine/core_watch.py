"""Notice the death of vLLM's EngineCore process in the actor's event loop, at once.

vLLM notices it too, in its own monitor thread: that thread waits on the same process
sentinels, shuts its client down, and only that shutdown's cancellation of the output task
fails the open requests, a chain of vLLM internals in another thread.  An erlay engine only
needs to know that the process is gone to fail its streams over to other engines, so it
watches the sentinels itself: a sentinel is a file descriptor that becomes readable when its
process exits, and ``loop.add_reader`` runs the callback on the loop's next turn.
This does not make the bench's kill-to-stream-error stage shorter (173 ms in a run with it,
171-211 ms without, docs/performance.md); it takes vLLM's shutdown path out of the way the
failure travels, and the 0.5 s poll in the engine stays for a vLLM that hides its processes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def core_sentinels(llm: Any) -> list[int]:
    """The sentinels of ``llm``'s (an ``AsyncLLM``'s) EngineCore processes, or ``[]`` when
    this vLLM does not expose them (an external or Ray-managed engine, or another version):
    then vLLM's own monitor thread is the only watch, as before."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    sentinels = getattr(getattr(resources, "engine_manager", None), "sentinels", None)
    if not callable(sentinels):
        return []
    try:
        return [int(s) for s in sentinels()]
    except Exception:   # a convenience, never a start failure
        log.warning("cannot read vLLM's EngineCore sentinels", exc_info=True)
        return []


class SentinelWatch:
    """Calls ``on_exit`` once, from ``loop``, when any of ``sentinels`` becomes readable
    (its process exited).  :meth:`close` stops watching; call it before shutting vLLM down
    on purpose (the shutdown ends the processes and closes the descriptors)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sentinels: list[int],
                 on_exit: Callable[[], None]) -> None:
        self._loop = loop
        self._fds: list[int] = []
        self._on_exit = on_exit
        for fd in sentinels:
            loop.add_reader(fd, self._fired)
            self._fds.append(fd)

    @property
    def watching(self) -> bool:
        return bool(self._fds)

    def _fired(self) -> None:
        self.close()   # level-triggered: stop before the descriptor is closed or reused
        self._on_exit()

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            try:
                self._loop.remove_reader(fd)
            except (OSError, ValueError):   # closed already
                pass

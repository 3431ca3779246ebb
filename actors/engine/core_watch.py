"""Notice the death of vLLM's EngineCore process in the actor's event loop, at once.

vLLM notices it too, in its own monitor thread: that thread waits on the processes'
multiprocessing sentinels, shuts its client down, and only that shutdown's cancellation of
the output task fails the open requests, a chain of vLLM internals in another thread.  A
sentinel is also late: it is a pipe that reads EOF once every holder of its write end has
exited, and on CPU the EngineCore's own workers hold it too, so it fired only when they had
noticed their parent's death and exited (the bench's ``detect`` stage: about 250 ms).

An erlay engine only needs to know that the EngineCore process is gone to fail its streams
over to other engines, so it watches the process itself: a pidfd (Linux 5.3+) becomes
readable when that one process exits, and ``loop.add_reader`` runs the callback on the loop's
next turn.  Where pidfds are unavailable it watches the sentinels instead; where vLLM does
not expose its processes, the engine's 0.5 s poll of vLLM's own flag is the only watch.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

import psutil

log = logging.getLogger(__name__)


def core_processes(llm: Any) -> list[Any]:
    """``llm``'s (an ``AsyncLLM``'s) EngineCore processes (``multiprocessing`` process
    objects), or ``[]`` when this vLLM does not expose them (an external or Ray-managed
    engine, or another version)."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    processes = getattr(getattr(resources, "engine_manager", None), "processes", None)
    return list(processes) if isinstance(processes, list) else []


def exit_fds(processes: list[Any]) -> tuple[list[int], list[int]]:
    """File descriptors that become readable when each of ``processes`` exits: (fds to
    watch, those of them this function opened, for the caller to close).  A pidfd per
    process where the OS has them, else the process's sentinel."""
    fds: list[int] = []
    opened: list[int] = []
    for proc in processes:
        try:
            fd = os.pidfd_open(int(proc.pid))
        except (AttributeError, OSError):   # no pidfds here, or the process is gone already
            try:
                fds.append(int(proc.sentinel))
            except (AttributeError, TypeError, ValueError):
                log.warning("cannot watch vLLM's EngineCore process %r", proc)
            continue
        fds.append(fd)
        opened.append(fd)
    return fds, opened


class ExitWatch:
    """Calls ``on_exit`` once, from ``loop``, when any of ``processes`` exits.  :meth:`close`
    stops watching; call it before shutting vLLM down on purpose."""

    def __init__(self, loop: asyncio.AbstractEventLoop, processes: list[Any],
                 on_exit: Callable[[], None]) -> None:
        self._loop = loop
        self._on_exit = on_exit
        self._fds, self._opened = exit_fds(processes)
        for fd in self._fds:
            loop.add_reader(fd, self._fired)

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
        opened, self._opened = self._opened, []
        for fd in opened:
            try:
                os.close(fd)
            except OSError:
                pass


def engine_core_pid(workers: list[dict[str, Any]]) -> int | None:
    """The EngineCore's pid.  vLLM's workers run in it with one device on GPU (the ``uni``
    executor: the worker's parent is this actor), and as its children on CPU."""
    if not workers:
        return None
    worker = int(workers[0]["pid"])
    try:
        parent = psutil.Process(worker).ppid()
    except psutil.NoSuchProcess:
        return None
    return worker if parent == os.getpid() else parent

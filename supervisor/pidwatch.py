"""Notice a local process's exit on an asyncio loop, at once, through pidfds.

A pidfd (Linux 5.3+, :func:`os.pidfd_open`) becomes readable when its process exits, and
``loop.add_reader`` runs the callback on the loop's next turn: no thread, no polling, and no
need to be the process's parent.  Where pidfds are unavailable (another OS, an old kernel, a
sandbox that forbids the call) nothing is watched, and the caller keeps whatever slower
detection it had.

The kernel reports a process's exit (to its pidfd, and to its peers through its closed
sockets) only once it has freed the process's memory: for a SIGKILLed process of a few
hundred MB, tens of milliseconds after the kill.  The threads of a killed process each exit
first, within a millisecond or two, except the last one, which frees the memory.  So a
process that runs :func:`exit_beacons` (two idle threads that exit only with it) can be
watched through a pidfd on each beacon thread (``PIDFD_THREAD``, Linux 6.9+): one of the two
is not that last thread, and its exit says at once that the process is dying.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

PIDFD_THREAD = os.O_EXCL   # pidfd_open's flag for a pidfd on one thread (Linux 6.9+)
BEACONS = 2   # one beacon may be the thread that frees the memory; the other is not

_beacons: list[int] = []
_beacons_lock = threading.Lock()
_never = threading.Event()


def exit_beacons() -> list[int]:
    """The native thread ids of this process's exit beacons: idle daemon threads that exit
    only when the process does, started by the first call.  A watcher passes them to
    :meth:`PidWatch.watch` as ``threads``."""
    with _beacons_lock:
        while len(_beacons) < BEACONS:
            started: list[int] = []
            ready = threading.Event()
            threading.Thread(target=_beacon, args=(started, ready), daemon=True,
                             name=f"erlay-exit-beacon-{len(_beacons)}").start()
            ready.wait()
            _beacons.extend(started)
        return list(_beacons)


def _beacon(started: list[int], ready: threading.Event) -> None:
    started.append(threading.get_native_id())
    ready.set()
    _never.wait()


def _forget_beacons() -> None:
    """In a forked child, which has none of its parent's threads."""
    global _beacons_lock
    _beacons.clear()
    _beacons_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_beacons)


def open_pidfd(pid: int) -> int | None:
    """A pidfd for ``pid``, or None where this OS gives none.

    Raises ProcessLookupError when no process has that pid any more: it exited and was
    reaped (a zombie still gets a pidfd, readable at once)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except (AttributeError, OSError):   # no os.pidfd_open, ENOSYS, EPERM ...
        return None


def open_thread_pidfds(pid: int, threads: Sequence[int]) -> list[int]:
    """A pidfd on each of ``threads``, threads of process ``pid``; [] unless every one
    opens (a kernel before 6.9, a thread that is gone) and still belongs to ``pid`` once
    opened (a thread id is reused once its thread is gone)."""
    fds: list[int] = []
    try:
        for tid in threads:
            fds.append(os.pidfd_open(tid, PIDFD_THREAD))
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                raise ProcessLookupError(tid)
    except (AttributeError, OSError):
        for fd in fds:
            os.close(fd)
        return []
    return fds


@dataclass
class _Watched:
    """One watched process: its pidfds (none once it is known to have exited), and the
    callbacks waiting for its exit, by registration."""

    key: Hashable
    fds: list[int]
    callbacks: dict[int, Callable[[], None]] = field(default_factory=dict)
    pending: asyncio.Handle | None = None   # the call that reports an exit seen at open


class Watch:
    """One callback's registration with a :class:`PidWatch`; :meth:`cancel` unregisters it."""

    def __init__(self, owner: PidWatch, watched: _Watched, token: int) -> None:
        self._owner = owner
        self._watched = watched
        self._token = token

    def cancel(self) -> None:
        """Unregister the callback: it is not called from now on, even if the exit was
        seen already.  The process's pidfds are closed once no callback watches it.
        Idempotent."""
        self._owner._unwatch(self._watched, self._token)


class PidWatch:
    """Calls back, from ``loop``, when watched local processes exit.

    A process is watched under a key the caller chooses (``(path, incarnation)`` for a
    child), with one set of pidfds per key shared by every callback under it: one per exit
    beacon where the process has them and the kernel allows, else one for the process.
    Invariant: a key's pidfds are open exactly while its process has a callback and has not
    been seen to exit, so an exit, the last :meth:`Watch.cancel` or :meth:`close` closes
    them.  Each callback runs at most once, in a loop callback of its own (one that raises
    is reported by the loop and does not stop the others).  Use it from ``loop``'s thread
    only.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._watched: dict[Hashable, _Watched] = {}
        self._tokens = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop the callbacks run on."""
        return self._loop

    @property
    def watching(self) -> int:
        """Processes watched through open pidfds now."""
        return sum(bool(w.fds) for w in self._watched.values())

    def watch(self, key: Hashable, pid: int, callback: Callable[[], None],
              threads: Sequence[int] = ()) -> Watch | None:
        """Call ``callback`` once process ``pid`` is dying (one of its ``threads``, its
        :func:`exit_beacons`, has exited) or has exited: on the loop's next turn if it has
        already.  ``pid`` and ``threads`` are read only by the first watch of ``key``.

        Returns the registration, or None where pidfds are unavailable: then nothing
        watches and ``callback`` is never called."""
        watched = self._watched.get(key)
        if watched is None:
            watched = self._open(key, pid, threads)
            if watched is None:
                return None
            self._watched[key] = watched
        self._tokens += 1
        watched.callbacks[self._tokens] = callback
        return Watch(self, watched, self._tokens)

    def _open(self, key: Hashable, pid: int, threads: Sequence[int]) -> _Watched | None:
        fds = open_thread_pidfds(pid, threads) if threads else []
        if not fds:
            try:
                fd = open_pidfd(pid)
            except ProcessLookupError:
                watched = _Watched(key, [])
                watched.pending = self._loop.call_soon(self._exited, watched)
                return watched
            if fd is None:
                return None
            fds = [fd]
        watched = _Watched(key, fds)
        for fd in fds:
            self._loop.add_reader(fd, self._exited, watched)
        return watched

    def _exited(self, watched: _Watched) -> None:
        self._forget(watched)   # level-triggered: stop before the fds are closed or reused
        for token in list(watched.callbacks):
            self._loop.call_soon(self._call, watched, token)

    @staticmethod
    def _call(watched: _Watched, token: int) -> None:
        callback = watched.callbacks.pop(token, None)
        if callback is not None:   # not unregistered since the exit was seen
            callback()

    def _unwatch(self, watched: _Watched, token: int) -> None:
        if watched.callbacks.pop(token, None) is not None and not watched.callbacks:
            self._forget(watched)

    def _forget(self, watched: _Watched) -> None:
        """Stop watching ``watched``'s process and close its pidfds."""
        if self._watched.get(watched.key) is watched:
            del self._watched[watched.key]
        if watched.pending is not None:
            watched.pending.cancel()
        fds, watched.fds = watched.fds, []
        for fd in fds:
            self._loop.remove_reader(fd)
            os.close(fd)

    def close(self) -> None:
        """Stop watching everything, without calling back; every pidfd is closed."""
        for watched in list(self._watched.values()):
            watched.callbacks.clear()
            self._forget(watched)

"""End the streams on an engine the moment its process dies, where that process is local.

Ray fails a streaming call to an actor whose process died once the death has reached the
caller through Ray's own machinery, which starts only after the kernel has freed the
process's memory (``bench/replay.py``'s ``failure_seen``).  An actor child's
``process.info`` names its pid, its node and its exit beacons
(:func:`erlay.supervisor.pidwatch.exit_beacons`), so for an engine on the coordinator's node
pidfds on its beacon threads report a SIGKILL within milliseconds, on the coordinator's loop,
and the streams on it fail over at once.  A kernel without pidfds for threads (before 6.9)
gets a pidfd on the process, which reports the exit once the memory is freed, still before
Ray does.  An engine on another node, or a host without pidfds, is watched by Ray alone.

Pids are compared on the assumption every child driver makes on its own node (see
:meth:`erlay.supervisor.actor_child.ActorProcess._sigkill_if_local`): Ray's workers on this
node share the driver's pid namespace.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from types import TracebackType
from typing import Any

import ray

from erlay.supervisor.errors import ChildNotRunning
from erlay.supervisor.pidwatch import PidWatch, Watch
from erlay.supervisor.tree import ChildRef


class EngineProcessExited(ChildNotRunning):
    """The engine's process died under a call: seen on this node, before Ray said so."""


class ExitGuard:
    """Within ``with``: when the engine's process dies, the task that entered is cancelled
    and the block raises :class:`EngineProcessExited` instead.  A cancellation from
    elsewhere (the coordinator stopping) propagates as ever, exit or not.

    An awaited call whose result arrives in the turn of the cancellation may return it and
    drop the cancellation (Python 3.11's ``asyncio.wait_for`` does), so the block calls
    :meth:`raise_if_exited` after each awaited item: an item that raced the exit does not
    hide it.
    """

    def __init__(self, path: str, pid: int | None, threads: Sequence[int],
                 pids: PidWatch | None, key: Hashable) -> None:
        self._path = path
        self._pid = pid
        self._threads = threads
        self._pids = pids
        self._key = key
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._watch: Watch | None = None
        self._cancelled = False   # the exit cancelled the task
        self.exited = False

    def __enter__(self) -> ExitGuard:
        if self._pids is not None and self._pid is not None:
            self._task = asyncio.current_task()
            assert self._task is not None, "enter an ExitGuard from a task"
            self._cancelling = self._task.cancelling()
            self._watch = self._pids.watch(self._key, self._pid, self._exited,
                                          self._threads)
        return self

    def _exited(self) -> None:
        self.exited = True
        assert self._task is not None
        self._cancelled = self._task.cancel(f"the process of {self._path} exited")

    def _error(self) -> EngineProcessExited:
        return EngineProcessExited(f"the process of {self._path} (pid {self._pid}) exited")

    def raise_if_exited(self) -> None:
        """Raise :class:`EngineProcessExited` if the engine's process has died."""
        if self.exited:
            raise self._error()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if not self._cancelled:
            return
        assert self._task is not None
        # Ours was the only cancellation since entering: the exit, not a stop, ended the
        # block (asyncio.timeout reads its own expiry the same way).
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise self._error() from None


class EngineExits:
    """The exit watch over the engines' local processes, for
    :class:`~erlay.actors.job.domains.EngineBatcher`: one set of pidfds per engine
    incarnation, shared by every call on it.  Use it from one event loop (the coordinator's).

    ``node_id`` is the Ray node this process runs on; by default Ray's, read once, at the
    first engine that could be local."""

    def __init__(self, node_id: str | None = None) -> None:
        self._pids: PidWatch | None = None   # made on the loop of the first call
        self._node_id = node_id

    @property
    def watching(self) -> int:
        """Engine processes watched now (their pidfds open)."""
        return 0 if self._pids is None else self._pids.watching

    def guard(self, engine: ChildRef) -> ExitGuard:
        """A guard for one call on ``engine``'s current incarnation; enter it from the task
        that awaits the call.  Raises ChildNotRunning while the engine has no incarnation.

        It does nothing (the block runs as if unguarded) where the engine's process is not
        on this node or pidfds are unavailable."""
        incarnation = engine.incarnation   # first: the pid read next is this one's or newer
        info = engine.process.info
        return ExitGuard(engine.path, self._local_pid(info), info.get("exit_tids", ()),
                         self._watch(), (engine.path, incarnation))

    def _local_pid(self, info: dict[str, Any]) -> int | None:
        """The pid of an actor child's process on this node, else None."""
        if info.get("kind") != "actor" or not info.get("pid") or not info.get("node_id"):
            return None
        if self._node_id is None:
            self._node_id = ray.get_runtime_context().get_node_id()
        return int(info["pid"]) if info["node_id"] == self._node_id else None

    def _watch(self) -> PidWatch:
        loop = asyncio.get_running_loop()
        if self._pids is None or self._pids.loop is not loop:
            self._pids = PidWatch(loop)
        return self._pids

"""In-process children: plain objects that live inside a hosting process (a node host).

The object's contract, all optional except construction:

- ``factory(*start.args, *instance_args, **start.kwargs)`` builds it; raising is a start
  failure.  ``async def setup(self)`` (if present) runs next; raising there is one too.
- ``async def run(self)``: its main loop.  Returning is a ``normal`` exit, raising a crash.
  Without ``run`` the object lives until it is stopped or a call crashes it.
- Calls go through :meth:`InProcessChild.call`.  As in an OTP ``gen_server``, an exception
  escaping a call crashes the child (it is restarted per its spec) and is re-raised to the
  caller.  Calling a method that does not exist raises ``AttributeError`` and crashes
  nothing: that is the caller's bug.
- ``stop()`` or ``close()`` (sync or async) is called for a graceful shutdown.
- ``progress``: a :class:`~erlay.supervisor.progress.Progress` read by hang detection.

In-process children share the host's event loop.  They must not block it; CPU-heavy or
untrusted work belongs in subprocess children.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Callable
from typing import Any

from erlay.supervisor.errors import ChildNotRunning
from erlay.supervisor.imports import import_path
from erlay.supervisor.progress import Progress, ProgressSnapshot
from erlay.supervisor.reason import KILLED, NORMAL, SHUTDOWN, ExitReason, from_exception
from erlay.supervisor.runtime import ChildProcess, StartContext
from erlay.supervisor.spec import InProcessStart, Shutdown, ShutdownKind


def resolve(target: Callable[..., Any] | str) -> Callable[..., Any]:
    """Return ``target``, importing it first when it is a ``"module:attr"`` path."""
    if not isinstance(target, str):
        return target
    return import_path(target, "hosted child")  # type: ignore[no-any-return]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class InProcessChild:
    """One incarnation of an in-process child."""

    def __init__(self, obj: Any, path: str) -> None:
        self.obj = obj
        self.path = path
        self.info: dict[str, Any] = {"kind": "in_process", "pid": os.getpid(),
                                     "class": type(obj).__name__}
        self._exit: asyncio.Future[ExitReason] = asyncio.get_running_loop().create_future()
        self._run_task: asyncio.Task[Any] | None = None

    @classmethod
    async def start(cls, ctx: StartContext) -> ChildProcess:
        start = ctx.spec.start
        assert isinstance(start, InProcessStart)
        obj = resolve(start.factory)(*start.args, *ctx.args, **start.kwargs)
        if hasattr(obj, "setup"):
            await _maybe_await(obj.setup())
        child = cls(obj, ctx.path)
        if hasattr(obj, "run"):
            child._run_task = asyncio.create_task(obj.run(), name=f"{ctx.path}:run")
            child._run_task.add_done_callback(child._run_ended)
        return child

    def _run_ended(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        self._end(NORMAL if exc is None else from_exception(exc))

    def _end(self, reason: ExitReason) -> None:
        if not self._exit.done():
            self._exit.set_result(reason)
        if self._run_task is not None and not self._run_task.done():
            self._run_task.cancel()

    @property
    def running(self) -> bool:
        return not self._exit.done()

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the object; an exception crashes the child and propagates."""
        if not self.running:
            raise ChildNotRunning(f"{self.path} is not running")
        fn = getattr(self.obj, method)
        try:
            result = fn(*args, **kwargs)
            # Awaited here rather than through _maybe_await: one coroutine fewer per call.
            return await result if inspect.isawaitable(result) else result
        except Exception as exc:
            self._end(from_exception(exc))
            raise

    async def wait(self) -> ExitReason:
        return await asyncio.shield(self._exit)

    async def stop(self, shutdown: Shutdown) -> ExitReason:
        if not self.running:
            return self._exit.result()
        if shutdown.kind is ShutdownKind.BRUTAL_KILL:
            self._end(KILLED)
            return KILLED
        stop_fn = getattr(self.obj, "stop", None) or getattr(self.obj, "close", None)
        reason = SHUTDOWN
        if stop_fn is not None:
            timeout = None if shutdown.kind is ShutdownKind.INFINITY else shutdown.timeout_s
            try:
                await asyncio.wait_for(_maybe_await(stop_fn()), timeout)
            except TimeoutError:
                reason = ExitReason(KILLED.kind, "did not stop within its shutdown timeout")
            except Exception as exc:  # noqa: BLE001 - a failing stop is a shutdown error
                reason = from_exception(exc)
        self._end(reason)
        return reason

    async def kill(self, reason: ExitReason) -> None:
        self._end(reason)

    async def progress(self, timeout_s: float) -> ProgressSnapshot | None:
        progress = getattr(self.obj, "progress", None)
        return progress.snapshot() if isinstance(progress, Progress) else None

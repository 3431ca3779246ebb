"""User code as a fault domain of its own: environments (and the rate rule for judges).

An environment is the user's code, and user code raises, hangs and returns garbage.  Each of
those fails the one sample it was called for, never the coordinator or the job:

- every call (``reset``, ``step``, ``observe``, ``demonstration``) runs on one of the
  guard's worker threads under a deadline, so a hang (a deadlock, an endless loop, a
  blocking read) costs that call ``timeout_s`` and nothing else: its thread is left behind
  (a thread cannot be killed) and a new one takes its place.  Calls may run concurrently,
  which the environment contract allows (environments are pure);
- what comes back is type-checked: ``reset`` returns an Episode, ``step`` an
  ``(Episode, StepResult)`` pair, ``observe`` an ``(Episode, str)`` pair;
- a failure becomes a :class:`UserCodeFailed` carrying a :class:`UserError`, the typed reason
  the journal and the report show: ``timeout`` for a hang, ``bad_return`` naming the type
  that came back, ``exception`` with the exception's class and message.

A plug-in that keeps failing is a bug to fix, not noise to absorb: :class:`FailureWindow`
watches each (class, method) over its last ``window`` calls, and once at least
``min_calls`` were made and more than ``max_rate`` of the window failed, the guard raises
:class:`PluginFailing`, and the job stops cleanly with one message that names the class, the
method and the first traceback.  The defaults never stop a plug-in that fails 15-20% of
calls at random (the chance that 30 of 40 such calls fail is below 1e-11), and stop one that
fails every call after 16 calls.

May import: erlay.supervisor, erlay.environments.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from erlay.environments.base import Episode, StepResult
from erlay.supervisor.errors import ErlayError
from erlay.supervisor.failpoints import failpoint

log = logging.getLogger("erlay.plugins")

Kind = Literal["exception", "timeout", "bad_return"]


@dataclass(frozen=True)
class UserError:
    """Why one call into user code failed: the typed reason a failed sample carries."""

    plugin: str          # the class path, e.g. "mypkg.envs:MyEnv"
    method: str          # "step"
    kind: Kind
    detail: str          # "ValueError: boom" | "no answer within 10 s" | "returned NoneType..."
    traceback: str = ""  # for kind "exception"

    @property
    def reason(self) -> str:
        """One line: ``user_error: mypkg.envs:MyEnv.step: exception: ValueError: boom``."""
        return f"user_error: {self.plugin}.{self.method}: {self.kind}: {self.detail}"

    def to_dict(self) -> dict[str, str]:
        return {"plugin": self.plugin, "method": self.method, "kind": self.kind,
                "detail": self.detail}


class UserCodeFailed(ErlayError):
    """One call into user code failed; the sample it was for fails with ``error``."""

    def __init__(self, error: UserError) -> None:
        self.error = error
        super().__init__(error.reason)


class PluginFailing(ErlayError):
    """A plug-in's method keeps failing past the configured rate: the job must stop.  The
    message names the class, the method, the rate and the first failure's traceback."""

    def __init__(self, first: UserError, failed: int, calls: int) -> None:
        self.first = first
        first_text = first.traceback.rstrip() or f"{first.kind}: {first.detail}"
        super().__init__(
            f"{first.plugin}.{first.method} keeps failing ({failed} of its last {calls} "
            f"calls); stopping the job.  First failure:\n{first_text}")


@dataclass(frozen=True)
class RateRule:
    """When a plug-in's method counts as broken (see the module docstring)."""

    window: int = 40
    max_rate: float = 0.75
    min_calls: int = 16


class FailureWindow:
    """The outcomes of one (class, method)'s last ``rule.window`` calls.  Pure."""

    def __init__(self, rule: RateRule = RateRule()) -> None:
        self.rule = rule
        self._outcomes: deque[bool] = deque(maxlen=rule.window)
        self.first_failure: UserError | None = None
        self.failures = 0

    def record(self, error: UserError | None) -> bool:
        """Record one call (``error`` None: it succeeded); True once the method is broken."""
        self._outcomes.append(error is None)
        if error is not None:
            self.failures += 1
            if self.first_failure is None:
                self.first_failure = error
        calls = len(self._outcomes)
        failed = calls - sum(self._outcomes)
        return calls >= self.rule.min_calls and failed > self.rule.max_rate * calls

    def counts(self) -> tuple[int, int]:
        """(failed, calls) within the window."""
        return len(self._outcomes) - sum(self._outcomes), len(self._outcomes)


def _is_pair(value: Any, second: type) -> bool:
    return (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Episode)
            and isinstance(value[1], second))


# method -> (check of the returned value, what was expected)
RETURNS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "reset": (lambda v: isinstance(v, Episode), "an Episode"),
    "step": (lambda v: _is_pair(v, StepResult), "a (Episode, StepResult) pair"),
    "observe": (lambda v: _is_pair(v, str), "a (Episode, str) pair"),
    "demonstration": (lambda v: isinstance(v, list) and all(
        isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p)
        for p in v), "a list of (str, str) pairs"),
}


def _type_name(value: Any) -> str:
    if isinstance(value, tuple):
        return f"tuple({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


class _Workers:
    """Threads that run user calls.  A call that hangs keeps its thread; :meth:`replace`
    starts another, so the others are never stuck behind it.  No call is ever cancelled
    from here: a caller that gives up just stops waiting."""

    def __init__(self, size: int) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        for _ in range(size):
            self.replace()

    def replace(self) -> None:
        thread = threading.Thread(target=self._serve, daemon=True,
                                  name=f"erlay-plugin-{len(self._threads)}")
        thread.start()
        self._threads.append(thread)

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, future, fn, args = job
            if future.cancelled():  # its caller gave up before it started
                continue
            try:
                outcome: tuple[bool, Any] = (True, _traced(fn, args))
            except _Raised as exc:
                outcome = (False, exc)
            try:
                loop.call_soon_threadsafe(_settle, future, outcome)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


def _settle(future: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if future.done():
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


class GuardedEnvironment:
    """An environment's methods as awaitables that fail the sample, not the caller.

    ``name`` and ``max_turns`` are read once, at construction.  Calls run on ``threads``
    worker threads; a call past ``timeout_s`` leaves its thread behind and a new one
    replaces it (``abandoned_threads`` counts them).
    """

    def __init__(self, env: Any, plugin: str, *, timeout_s: float = 10.0,
                 rule: RateRule = RateRule(), threads: int = 4) -> None:
        self.env = env
        self.plugin = plugin
        self.name = str(getattr(env, "name", plugin))
        self.max_turns = int(env.max_turns)
        self.timeout_s = timeout_s
        self.rule = rule
        self.windows: dict[str, FailureWindow] = {}
        self.abandoned_threads = 0
        self._warned: set[tuple[str, str]] = set()
        self._workers = _Workers(threads)

    async def call(self, method: str, *args: Any) -> Any:
        """``env.<method>(*args)``, checked.  Raises UserCodeFailed for this call's failure,
        PluginFailing once the method's failure rate says the plug-in is broken."""
        error: UserError | None = None
        value: Any = None
        future = self._workers.submit(getattr(self.env, method), args)
        try:
            value = await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            error = UserError(self.plugin, method, "timeout",
                              f"no answer within {self.timeout_s:g} s")
            self.abandoned_threads += 1
            self._workers.replace()
        except _Raised as exc:
            error = UserError(self.plugin, method, "exception", exc.summary, exc.text)
        else:
            check, expected = RETURNS[method]
            if not check(value):
                error = UserError(self.plugin, method, "bad_return",
                                  f"returned {_type_name(value)}, expected {expected}")
        window = self.windows.setdefault(method, FailureWindow(self.rule))
        if window.record(error):
            failed, calls = window.counts()
            raise PluginFailing(window.first_failure or error, failed, calls)  # type: ignore[arg-type]
        if error is not None:
            # The first failure of each kind is worth a warning with its traceback; the rest
            # are counted (the step's user_errors) and logged at debug level only, so a
            # plug-in failing 15% of a long job's calls does not flood the log.
            first = (method, error.kind) not in self._warned
            self._warned.add((method, error.kind))
            log.log(logging.WARNING if first else logging.DEBUG, "%s%s", error.reason,
                    f"\n{error.traceback}" if first and error.traceback else "")
            raise UserCodeFailed(error)
        return value

    async def reset(self, index: int, seed: int) -> Episode:
        return await self.call("reset", index, seed)  # type: ignore[no-any-return]

    async def step(self, episode: Episode, completion: str) -> tuple[Episode, StepResult]:
        return await self.call("step", episode, completion)  # type: ignore[no-any-return]

    async def observe(self, episode: Episode, tool_output: str,
                      ok: bool = True) -> tuple[Episode, str]:
        return await self.call("observe", episode, tool_output, ok)  # type: ignore[no-any-return]

    async def demonstration(self, episode: Episode) -> list[tuple[str, str]]:
        return await self.call("demonstration", episode)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._workers.close()


class _Raised(Exception):
    """What user code raised, carried out of the worker thread with its traceback."""

    def __init__(self, exc: BaseException) -> None:
        self.summary = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        self.text = "".join(traceback.format_exception(exc))
        super().__init__(self.summary)


def _traced(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    try:
        if failpoint("environment.call"):  # chaos: the user's code returns garbage
            return None
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - user code: every exception is a typed reason
        raise _Raised(exc) from None

"""User code as a fault domain of its own: what a call into a plug-in may end in, and the
rule that stops a plug-in that keeps failing.

User code raises, hangs, returns garbage and kills its process.  Each of those fails the one
sample it was called for, never the coordinator or the job.  The code runs in worker
processes of the per-node hosts (:mod:`erlay.supervisor.worker_process`; the environment's
in :mod:`~erlay.actors.job.env_worker`, the judge's in :mod:`erlay.judges.server`), never in
the driver, so a call that freezes its process (a C call holding the GIL) costs that worker,
found by its deadline.  A failure is a :class:`UserError`, the typed reason the journal and
the report show:

- ``exception``: the call raised (:func:`run_checked` keeps the class, message, traceback);
- ``bad_return``: it returned the wrong type, or a value that cannot be sent back
  (``reset`` returns an Episode, ``step`` an ``(Episode, StepResult)`` pair, ``observe`` an
  ``(Episode, str)`` pair, ``demonstration`` a list of ``(str, str)`` pairs);
- ``timeout``: no answer within the deadline; its worker process was killed and replaced;
- ``poison``: the call killed its worker process twice (its first death may have been the
  machine's doing, so it is tried once more; a second is the input's), and is not tried
  again.

A plug-in that keeps failing is a bug to fix, not noise to absorb: :class:`FailureWindow`
watches each (class, method) over its last ``window`` calls, and once at least
``min_calls`` were made and more than ``max_rate`` of the window failed, the caller raises
:class:`PluginFailing`, and the job stops cleanly with one message that names the class, the
method and the first traceback.  The defaults never stop a plug-in that fails 15-20% of
calls at random (the chance that 30 of 40 such calls fail is below 1e-11), and stop one that
fails every call after 16 calls.

May import: erlay.supervisor, erlay.environments.
"""

from __future__ import annotations

import logging
import pickle
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from erlay.environments.base import Episode, StepResult
from erlay.supervisor.errors import ErlayError
from erlay.supervisor.failpoints import failpoint

log = logging.getLogger("erlay.plugins")

Kind = Literal["exception", "timeout", "bad_return", "poison"]


@dataclass(frozen=True)
class UserError:
    """Why one call into user code failed: the typed reason a failed sample carries."""

    plugin: str          # the class path, e.g. "mypkg.envs:MyEnv"
    method: str          # "step"
    kind: Kind           # poison: the call killed its worker process twice
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


@dataclass(frozen=True)
class PluginReply:
    """What one call into user code gave, as a worker process sends it back: the value, or
    the :class:`UserError` it failed with (never both)."""

    value: Any = None
    error: UserError | None = None


def run_checked(obj: Any, plugin: str, method: str, args: tuple[Any, ...]) -> PluginReply:
    """``obj.<method>(*args)`` as user code: an exception is a ``exception`` failure with its
    traceback, a value of the wrong type (or one that cannot be pickled back) a
    ``bad_return``.  Runs inside a worker process, on its main thread; a hang or a crash is
    its host's to find (``timeout``, ``poison``)."""
    try:
        value = _traced(getattr(obj, method), args)
    except _Raised as exc:
        return PluginReply(error=UserError(plugin, method, "exception", exc.summary, exc.text))
    check, expected = RETURNS[method]
    if not check(value):
        return PluginReply(error=UserError(plugin, method, "bad_return",
                                           f"returned {_type_name(value)}, expected {expected}"))
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - user data: any pickling error is a bad return
        return PluginReply(error=UserError(plugin, method, "bad_return",
                                           f"returned a value that cannot be sent back "
                                           f"({type(exc).__name__}: {exc})"[:300]))
    return PluginReply(value)


class _Raised(Exception):
    """What user code raised, with its traceback."""

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

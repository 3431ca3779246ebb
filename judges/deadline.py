"""Time budgets for blocking judge code inside a judge: one daemon thread per call, abandoned
on overrun.  (A judgement's own deadline is its worker process's: the host kills the process
when it passes; this budget is a judge's first line, which answers without losing it.)

Why a fresh thread per call and not a pool: Python cannot interrupt a thread, so a call that
overruns its budget keeps its thread until it finishes on its own.  In a pool it would hold a
worker, and a few such calls would starve every later one; worse, ``ThreadPoolExecutor``
joins its threads at interpreter exit, so one wedged judgement would hang the host's
shutdown.  A daemon thread costs about a tenth of a millisecond to start and never blocks
exit.

Limit, stated plainly: a budget is enforced only while the overrunning code lets go of the
GIL (pure-Python loops do, every few milliseconds).  C code that holds the GIL, such as a
huge-integer power inside sympy, freezes the whole process, budget or not.  Judges therefore
screen inputs that could trigger such work *before* doing it, and the judgement's deadline in
its host is the backstop: the frozen worker process is killed and replaced.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from erlay.supervisor.errors import ErlayError

T = TypeVar("T")


class BudgetExceeded(ErlayError, TimeoutError):
    """A bounded call did not finish within its budget; its thread was abandoned."""


def call_with_budget(fn: Callable[..., T], *args: Any, budget_s: float,
                     name: str = "erlay-judge", **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` run in a daemon thread: its value, or its exception re-raised
    here, or :class:`BudgetExceeded` when it has not finished after ``budget_s`` seconds."""
    outcome: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, not swallowed
            outcome.append((False, exc))

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(budget_s)
    if not outcome:
        raise BudgetExceeded(f"{name}: not finished within {budget_s:g} s")
    ok, value = outcome[0]
    if ok:
        return value  # type: ignore[no-any-return]
    raise value

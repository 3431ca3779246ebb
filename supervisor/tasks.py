"""Task work: short-lived work (one judge call, one sandbox run, a probe) as a Ray task with
a deadline and a retry budget, never as an actor.

An attempt that misses its deadline is cancelled (``force=True`` kills the worker running
it) and retried; so is one whose worker or node died.  An exception raised by the function
itself is the task's answer and is not retried unless the policy says so.  When the budget
is spent the caller gets :class:`~erlay.supervisor.errors.TaskDeadlineExceeded` (every attempt
timed out) or :class:`~erlay.supervisor.errors.TaskFailed` naming the last cause.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayTaskError

from erlay.supervisor.errors import TaskDeadlineExceeded, TaskFailed

log = logging.getLogger("erlay.supervisor")
_REMOTES: dict[Callable[..., Any], Any] = {}


@dataclass(frozen=True)
class TaskPolicy:
    deadline_s: float = 30.0
    retries: int = 2
    backoff_s: float = 0.05
    retry_exceptions: bool = False
    num_cpus: float = 0


def _remote(fn: Callable[..., Any], num_cpus: float) -> Any:
    key = (fn, num_cpus)
    if key not in _REMOTES:
        _REMOTES[key] = ray.remote(num_cpus=num_cpus, max_retries=0)(fn)  # type: ignore[index]
    return _REMOTES[key]  # type: ignore[index]


async def _get(ref: Any) -> Any:
    return await ref


async def run_task(fn: Callable[..., Any], *args: Any, name: str,
                   policy: TaskPolicy = TaskPolicy(), **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` as a Ray task named ``name`` under ``policy``."""
    remote = _remote(fn, policy.num_cpus)
    deadlines = 0
    cause = ""
    attempts = policy.retries + 1
    for attempt in range(1, attempts + 1):
        ref = remote.options(name=name).remote(*args, **kwargs)
        try:
            return await asyncio.wait_for(_get(ref), policy.deadline_s)
        except TimeoutError:
            ray.cancel(ref, force=True)
            deadlines += 1
            cause = f"deadline of {policy.deadline_s:g} s exceeded"
        except RayTaskError as exc:
            cause = f"{type(exc.cause).__name__}: {exc.cause}" if exc.cause else str(exc)
            if not policy.retry_exceptions:
                raise TaskFailed(name, attempt, cause) from exc.cause
        except ray.exceptions.RayError as exc:  # worker or node died, object lost
            cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.warning("task %s attempt %d/%d failed: %s", name, attempt, attempts, cause)
        if attempt < attempts:
            await asyncio.sleep(policy.backoff_s * 2 ** (attempt - 1))
    if deadlines == attempts:
        raise TaskDeadlineExceeded(f"task {name}: all {attempts} attempt(s) missed the "
                                   f"{policy.deadline_s:g} s deadline")
    raise TaskFailed(name, attempts, cause)

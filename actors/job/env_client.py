"""The environment as the coordinator calls it: every call runs in a worker process of an
environment host, never in the driver.

:class:`EnvironmentClient` has the environment's methods as awaitables (``reset``, ``step``,
``observe``, ``demonstration``) and its ``name``, ``max_turns`` and ``tools``.  Each call is a
:class:`~erlay.supervisor.worker_process.WorkerCall` of
:meth:`~erlay.actors.job.env_worker.EnvironmentServer.call`, run by a :class:`Transport`
(:class:`~erlay.actors.job.hostcalls.HostCalls` in a job).  What comes back decides:

============  ==============================================================================
outcome       what the call gives
============  ==============================================================================
ok            the value, or the user's own failure (``exception``, ``bad_return``) as
              :class:`~erlay.actors.job.plugins.UserCodeFailed`: never retried, because a
              pure environment fails the same way again
timeout       ``UserCodeFailed`` with kind ``timeout``: the worker was killed at the deadline;
              not retried, so a frozen call costs its sample the deadline and no more
died          tried once more: a process may die of the machine's doing (the OOM killer).  A
              second death is the input's: ``UserCodeFailed`` with kind ``poison``
lost          the infrastructure's failure (a host restarting, a worker stopped from
              outside): retried, with a pause, until ``unavailable_s`` has passed; then
              :class:`EnvironmentUnavailable` (the coordinator crashes and replays)
============  ==============================================================================

Each user failure, poison included, counts in the method's
:class:`~erlay.actors.job.plugins.FailureWindow`; a method past its rate raises
:class:`~erlay.actors.job.plugins.PluginFailing`, which stops the job.  ``poisoned`` counts
the poison inputs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from erlay.actors.job.env_worker import EnvironmentInfo, Which
from erlay.actors.job.plugins import (
    FailureWindow,
    PluginFailing,
    PluginReply,
    RateRule,
    UserCodeFailed,
    UserError,
)
from erlay.environments.base import Episode, StepResult
from erlay.supervisor.errors import ChildNotRunning
from erlay.supervisor.worker_process import CallOutcome, WorkerCall

log = logging.getLogger("erlay.plugins")

Transport = Callable[[WorkerCall], Awaitable[CallOutcome]]
LOST_PAUSE_S = 0.2


class EnvironmentUnavailable(ChildNotRunning):
    """No environment worker could run a call for ``unavailable_s``: the environment domain
    is down, not the user's code."""


class EnvironmentClient:
    """One of the job's environments (``which``: ``train`` or ``validation``), reached
    through ``transport``.  ``info`` is what :meth:`EnvironmentServer.describe` said of it."""

    def __init__(self, transport: Transport, plugin: str, info: EnvironmentInfo, *,
                 which: Which = "train", timeout_s: float = 10.0,
                 rule: RateRule = RateRule(), unavailable_s: float = 300.0) -> None:
        self.transport = transport
        self.plugin = plugin
        self.which = which
        self.name = info.name
        self.max_turns = info.max_turns
        self.tools = info.tools
        self.timeout_s = timeout_s
        self.rule = rule
        self.unavailable_s = unavailable_s
        self.windows: dict[str, FailureWindow] = {}
        self.poisoned = 0
        self.retried_deaths = 0
        self._warned: set[tuple[str, str]] = set()

    @staticmethod
    async def describe(transport: Transport, unavailable_s: float = 300.0
                       ) -> dict[str, EnvironmentInfo]:
        """What the environment workers built, by ``train`` / ``validation``; raises
        :class:`EnvironmentUnavailable` when no worker answers within ``unavailable_s``."""
        give_up = time.monotonic() + unavailable_s
        while True:
            outcome = await transport(WorkerCall("describe"))
            if outcome.ok:
                return outcome.value  # type: ignore[no-any-return]
            if time.monotonic() > give_up:
                raise EnvironmentUnavailable(f"no environment worker answered describe: "
                                             f"{outcome.kind}: {outcome.detail}")
            await asyncio.sleep(LOST_PAUSE_S)

    async def call(self, method: str, *args: Any) -> Any:
        """``env.<method>(*args)`` in a worker process.  Raises UserCodeFailed for this
        call's failure, PluginFailing once the method's failure rate says the plug-in is
        broken, EnvironmentUnavailable when no worker can run it."""
        error = await self._attempts(method, args)
        window = self.windows.setdefault(method, FailureWindow(self.rule))
        if isinstance(error, PluginReply):
            window.record(None)
            return error.value
        if window.record(error):
            failed, calls = window.counts()
            raise PluginFailing(window.first_failure or error, failed, calls)
        # The first failure of each kind is worth a warning with its traceback; the rest are
        # counted (the step's user_errors) and logged at debug level only.
        first = (method, error.kind) not in self._warned
        self._warned.add((method, error.kind))
        log.log(logging.WARNING if first else logging.DEBUG, "%s%s", error.reason,
                f"\n{error.traceback}" if first and error.traceback else "")
        raise UserCodeFailed(error)

    async def _attempts(self, method: str, args: tuple[Any, ...]) -> PluginReply | UserError:
        """The call's reply, or its user error, after the retries the table above allows."""
        call = WorkerCall("call", (self.which, method, args), timeout_s=self.timeout_s,
                          label=f"{self.plugin}.{method}")
        give_up = time.monotonic() + self.unavailable_s
        deaths: list[str] = []
        while True:
            outcome = await self.transport(call)
            match outcome.kind:
                case "ok":
                    reply: PluginReply = outcome.value
                    return reply if reply.error is None else reply.error
                case "timeout":
                    return UserError(self.plugin, method, "timeout",
                                     f"no answer within {self.timeout_s:g} s (its worker "
                                     "process was killed and replaced)")
                case "died":
                    deaths.append(outcome.detail)
                    if len(deaths) >= 2:
                        self.poisoned += 1
                        return UserError(self.plugin, method, "poison",
                                         f"killed its worker process twice ({deaths[-1]}); "
                                         "not tried again")
                    self.retried_deaths += 1
                    log.warning("%s.%s: %s; trying it once more", self.plugin, method,
                                outcome.detail)
                case "lost":
                    if time.monotonic() > give_up:
                        raise EnvironmentUnavailable(
                            f"{self.plugin}.{method}: no environment worker ran it within "
                            f"{self.unavailable_s:g} s ({outcome.detail})")
                    await asyncio.sleep(LOST_PAUSE_S)

    async def reset(self, index: int, seed: int) -> Episode:
        return await self.call("reset", index, seed)  # type: ignore[no-any-return]

    async def step(self, episode: Episode, completion: str) -> tuple[Episode, StepResult]:
        return await self.call("step", episode, completion)  # type: ignore[no-any-return]

    async def observe(self, episode: Episode, tool_output: str,
                      ok: bool = True) -> tuple[Episode, str]:
        return await self.call("observe", episode, tool_output, ok)  # type: ignore[no-any-return]

    async def demonstration(self, episode: Episode) -> list[tuple[str, str]]:
        return await self.call("demonstration", episode)  # type: ignore[no-any-return]

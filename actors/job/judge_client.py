"""The judge as the coordinator calls it: each judgement runs in a worker process of a judge
host, one at a time, under ``judge.timeout_s``.

:class:`JudgeClient` turns what a judgement comes back as into the sample's verdict.  The
judge's own failures are the sample's, and are told apart from the infrastructure's:

============  ==============================================================================
outcome       the sample's judgement
============  ==============================================================================
ok            the worker's :class:`~erlay.judges.base.Judgement`: decided, or undecided
              with the judge's own cause (``exception``, ``bad_return``) -- not retried: a
              judge fails the same input the same way again
timeout       undecided, kind ``timeout``: the worker was killed at the deadline and
              replaced; not retried, so a frozen judgement costs its sample the deadline
died          tried once more (a process may die of the machine's doing); a second death is
              the input's: undecided, kind ``poison``, not tried again
lost          the infrastructure's failure (a host down or restarting, a worker stopped from
              outside): retried up to ``retries`` times on any host, then undecided, kind
              ``unavailable``
============  ==============================================================================

Only ``lost`` outcomes reach the hosts' circuit breakers
(:class:`~erlay.actors.job.hostcalls.HostCalls`): a judge failing on its inputs never knocks
out the healthy judgements of its host.  Judge failures that are the judge's own (timeout,
exception, bad return, poison) count against the judge class's failure rate
(:class:`~erlay.actors.job.plugins.FailureWindow`): a judge that keeps failing raises
:class:`~erlay.actors.job.plugins.PluginFailing`, which stops the job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from erlay.actors.job.plugins import FailureWindow, PluginFailing, RateRule, UserError
from erlay.judges.base import JUDGE_TIMEOUT, USER_ERROR_KINDS, Judgement
from erlay.supervisor.worker_process import CallOutcome, WorkerCall

log = logging.getLogger("erlay.rollout")

Transport = Callable[[WorkerCall], Awaitable[CallOutcome]]


class JudgeClient:
    """Scores through ``transport`` (the judge hosts' worker processes); see the module
    docstring for what each outcome gives."""

    def __init__(self, transport: Transport, judge_path: str, *, retries: int,
                 timeout_s: float, rule: RateRule = RateRule(),
                 pause_s: float = 0.05, deadline: Callable[[], float] | None = None) -> None:
        self.transport = transport
        # Each judgement's deadline: ``timeout_s``, or what ``deadline`` says (the goodput
        # controller's adaptive one, never above ``timeout_s``).
        self.deadline = deadline or (lambda: timeout_s)
        self.judge_path = judge_path
        self.retries = retries
        self.timeout_s = timeout_s
        self.pause_s = pause_s
        self.window = FailureWindow(rule)
        self.calls = 0
        self.failures = 0
        self.poisoned = 0
        self.retried_deaths = 0

    async def score(self, key: str, judge_input: str, answer: str,
                    trace: dict[str, str] | None = None, *, prompt: str = "") -> dict[str, Any]:
        """A Judgement dict: decided, or ``ok=False`` with its reason and ``kind``.
        ``prompt`` (the episode's prompt) reaches the judge in its ``context``."""
        judgement = await self._judgement(key, judge_input, answer, trace, prompt)
        self._account(judgement)
        if not judgement.ok:
            self.failures += 1
        return judgement.to_dict()

    async def _judgement(self, key: str, judge_input: str, answer: str,
                         trace: dict[str, str] | None, prompt: str) -> Judgement:
        timeout_s = self.deadline()
        call = WorkerCall("score", (judge_input, answer, key, trace), {"prompt": prompt},
                          timeout_s=timeout_s, label=f"{self.judge_path}.score {key}")
        deaths: list[str] = []
        lost = 0
        while True:
            self.calls += 1
            outcome = await self.transport(call)
            match outcome.kind:
                case "ok":
                    return outcome.value  # type: ignore[no-any-return]
                case "timeout":
                    return Judgement.undecided(
                        f"{JUDGE_TIMEOUT}: {self.judge_path}.score gave no answer within "
                        f"{timeout_s:g} s (its worker process was replaced)", "timeout")
                case "died":
                    deaths.append(outcome.detail)
                    if len(deaths) >= 2:
                        self.poisoned += 1
                        return Judgement.undecided(
                            f"judge poison: {self.judge_path}.score killed its worker "
                            f"process twice ({deaths[-1]}); not tried again", "poison")
                    self.retried_deaths += 1
                    log.warning("judgement %s: %s; trying it once more", key, outcome.detail)
                case "lost":
                    lost += 1
                    if lost > self.retries:
                        return Judgement.undecided(
                            f"judge unavailable after {lost} attempt(s): {outcome.detail}",
                            "unavailable")
                    await asyncio.sleep(self.pause_s * 2 ** (lost - 1))

    def _account(self, judgement: Judgement) -> None:
        """Feed the judge class's failure window: only its own failures count."""
        error = None
        if not judgement.ok:
            if judgement.kind not in USER_ERROR_KINDS:
                return  # an infrastructure failure says nothing about the judge's code
            error = UserError(self.judge_path, "score", judgement.kind,  # type: ignore[arg-type]
                              judgement.reason)
        if self.window.record(error):
            failed, calls = self.window.counts()
            raise PluginFailing(self.window.first_failure or error, failed, calls)  # type: ignore[arg-type]

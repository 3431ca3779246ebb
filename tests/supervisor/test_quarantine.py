"""An unreachable actor child is quarantined and probed until alive or confirmed dead.

Ray raises ActorUnavailableError only in network trouble that a one-machine test cannot
stage reliably, so the actor handle here is a fake that raises Ray's real exceptions in the
order a partition produces them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError

from erlay.supervisor.actor_child import ActorProcess
from erlay.supervisor.events import EventKind, MemorySink
from erlay.supervisor.reason import ExitKind
from erlay.supervisor.runtime import StartContext, Supervisor
from erlay.supervisor.spec import ChildSpec, InProcessStart, SupervisorFlags

UNAVAILABLE = ActorUnavailableError("connection to the node lost", None)


class FakeMethod:
    def __init__(self, outcomes: deque[Any]) -> None:
        self.outcomes = outcomes

    def remote(self) -> Any:
        outcome = self.outcomes.popleft() if self.outcomes else "hang"

        async def result() -> Any:
            if outcome == "hang":
                await asyncio.sleep(3600)
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        return result()


class FakeHandle:
    def __init__(self, monitor: Iterable[Any], probes: Iterable[Any]) -> None:
        self._erlay_monitor = FakeMethod(deque(monitor))
        self._erlay_progress = FakeMethod(deque(probes))


def process(handle: FakeHandle, sink: MemorySink, quarantine_s: float = 5.0) -> ActorProcess:
    sup = Supervisor("root", SupervisorFlags(), [], starters={}, sink=sink)
    ctx = StartContext(ChildSpec("engine", InProcessStart(dict)), "root/engine", 1, (), sup)
    proc = ActorProcess(handle, ctx, {"pid": None, "node_id": None}, quarantine_s, 0.01)
    proc._discard = lambda: None  # type: ignore[method-assign]  # no real actor to kill
    return proc


def test_unreachable_child_that_answers_a_probe_recovers_and_keeps_running() -> None:
    sink = MemorySink()
    handle = FakeHandle(monitor=[UNAVAILABLE, ActorDiedError()], probes=[UNAVAILABLE, {}])
    reason = asyncio.run(process(handle, sink).wait())
    kinds = [e.context for e in sink.events]
    assert kinds == [EventKind.QUARANTINE, EventKind.RECOVERED]
    assert reason.kind is ExitKind.ERROR  # it died later, for real, after recovering


def test_unreachable_child_confirmed_dead_by_a_probe_is_lost() -> None:
    sink = MemorySink()
    handle = FakeHandle(monitor=[UNAVAILABLE], probes=[UNAVAILABLE, ActorDiedError()])
    reason = asyncio.run(process(handle, sink).wait())
    assert reason.kind is ExitKind.LOST
    assert [e.context for e in sink.events] == [EventKind.QUARANTINE]


def test_child_unreachable_past_the_quarantine_timeout_is_lost() -> None:
    sink = MemorySink()
    handle = FakeHandle(monitor=[UNAVAILABLE], probes=[UNAVAILABLE] * 1000)
    reason = asyncio.run(asyncio.wait_for(process(handle, sink, quarantine_s=0.1).wait(), 5))
    assert reason.kind is ExitKind.LOST and "quarantine" in reason.detail

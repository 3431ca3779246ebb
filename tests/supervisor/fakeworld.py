"""A Ray-free world that carries out the decision core's plans, for conformance tests.

It follows the plan contract in :mod:`erlay.supervisor.core` exactly as the real shell does:
results of starts and stops are fed back at once, a failed start replaces the rest of the
plan, and try-again restarts go to the back of the queue.  Delayed restarts wait in
``timers`` until :meth:`FakeWorld.advance` moves the clock past them.  Children are just
``id -> incarnation`` entries in ``alive``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from erlay.supervisor import core
from erlay.supervisor.clock import FakeClock
from erlay.supervisor.events import EventKind
from erlay.supervisor.reason import KILLED, SHUTDOWN, ExitReason
from erlay.supervisor.spec import ChildSpec, InProcessStart, ShutdownKind, SupervisorFlags


def worker(cid: str, **kw: Any) -> ChildSpec:
    """A child spec whose start is never run here; only its id and flags matter."""
    return ChildSpec(cid, InProcessStart("tests.supervisor.fakeworld:worker"), **kw)


@dataclass
class FakeWorld:
    flags: SupervisorFlags
    specs: tuple[ChildSpec, ...]
    path: str = "root"
    clock: FakeClock = field(default_factory=FakeClock)

    def __post_init__(self) -> None:
        self.state = core.init_state(self.path, self.flags, tuple(self.specs))
        self.alive: dict[str, int] = {}
        self.fail_starts: dict[str, int] = {}      # id -> failures still to come (-1: always)
        self.stop_reason: dict[str, ExitReason] = {}  # how a child will answer a stop
        self.reports: list[core.Report] = []
        self.replies: dict[int, core.Reply] = {}
        self.started: list[tuple[str, int]] = []
        self.stopped: list[str] = []
        self.stop_batches: list[tuple[str, ...]] = []
        self.terminated: ExitReason | None = None
        self._queue: deque[core.Event] = deque()
        self._refs = count(1)
        self.timers: list[tuple[float, core.Event]] = []   # (due, event): ScheduleRestart

    # -- driving ---------------------------------------------------------------------------
    def feed(self, event: core.Event) -> None:
        self._queue.append(event)
        while self._queue:
            ev = self._queue.popleft()
            decision = core.decide(self.state, ev, self.clock.monotonic())
            self.state = decision.state
            self._run(decision.actions)

    def boot(self) -> FakeWorld:
        self.feed(core.Boot())
        return self

    def advance(self, seconds: float) -> None:
        """Move the clock; feed every timer now due, earliest first."""
        self.clock.advance(seconds)
        while due := sorted((t for t in self.timers if t[0] <= self.clock.monotonic()),
                            key=lambda t: t[0]):
            self.timers.remove(due[0])
            self.feed(due[0][1])

    def crash(self, cid: str, reason: ExitReason | None = None) -> None:
        inc = self.alive.pop(cid)
        self.feed(core.ChildExited(cid, inc, reason or ExitReason(core.ExitKind.ERROR, "boom")))

    def exit_normally(self, cid: str) -> None:
        self.crash(cid, ExitReason(core.ExitKind.NORMAL))

    def call(self, make: Any) -> core.Reply:
        ref = next(self._refs)
        self.feed(make(ref))
        return self.replies[ref]

    # -- queries ---------------------------------------------------------------------------
    def status(self, cid: str) -> core.ChildStatus:
        return self.state.children[cid].status

    def reported(self, kind: EventKind) -> list[core.Report]:
        return [r for r in self.reports if r.kind is kind]

    # -- the plan executor -----------------------------------------------------------------
    def _feedback(self, event: core.Event, plan: deque[core.Action], replace: bool) -> deque:
        decision = core.decide(self.state, event, self.clock.monotonic())
        self.state = decision.state
        return deque(decision.actions) if replace else deque(decision.actions) + plan

    def _stop_result(self, cid: str) -> ExitReason:
        if cid in self.stop_reason:
            return self.stop_reason[cid]
        spec = self.state.children[cid].spec
        return KILLED if spec.shutdown_policy.kind is ShutdownKind.BRUTAL_KILL else SHUTDOWN

    def _run(self, actions: tuple[core.Action, ...]) -> None:
        plan: deque[core.Action] = deque(actions)
        while plan:
            action = plan.popleft()
            match action:
                case core.Start(cid, inc, ctx, ref):
                    left = self.fail_starts.get(cid, 0)
                    if left != 0:
                        self.fail_starts[cid] = left - 1 if left > 0 else -1
                        plan = self._feedback(core.StartFailed(cid, inc, "start refused", ctx,
                                                               ref), plan, replace=True)
                        continue
                    self.alive[cid] = inc
                    self.started.append((cid, inc))
                    plan = self._feedback(core.Started(cid, inc, ctx, ref), plan, False)
                case core.Stop(cid, inc, remove):
                    reason = self._stop_result(cid)
                    if self.alive.pop(cid, None) is not None:
                        self.stopped.append(cid)
                    self.stop_batches.append((cid,))
                    plan = self._feedback(core.Stopped(cid, inc, reason, remove), plan, False)
                case core.StopMany(children):
                    self.stop_batches.append(tuple(c for c, _ in children))
                    for cid, inc in children:
                        reason = self._stop_result(cid)
                        self.alive.pop(cid, None)
                        self.stopped.append(cid)
                        plan = self._feedback(core.Stopped(cid, inc, reason), plan, False)
                case core.Report():
                    self.reports.append(action)
                case core.Reply():
                    self.replies[action.ref] = action
                case core.ScheduleTryAgain(cid):
                    self._queue.append(core.TryAgainRestart(cid))
                case core.ScheduleRestart(cid, delay_s, restart):
                    self.timers.append((self.clock.monotonic() + delay_s,
                                        core.RestartDue(cid, restart)))
                case core.Terminate(reason):
                    self.terminated = reason

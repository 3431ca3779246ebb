"""The supervisor's decision core: a pure function of (state, event, now).

``decide(state, event, now)`` returns the next state and a *plan*: a tuple of actions for the
shell to carry out.  Nothing here touches Ray, threads or the clock; time comes in as ``now``
(monotonic seconds).  This module is OTP's ``supervisor.erl`` restated as data.

The plan contract, which the shell (:mod:`erlay.supervisor.runtime`) must honour:

- Actions run in order.  The outcome of every :class:`Start` (``Started`` or
  ``StartFailed``) and every :class:`Stop` (``Stopped``) is fed back through ``decide`` at
  once, before any other event.
- A ``StartFailed`` aborts the rest of the current plan; the actions of its decision become
  the new plan.  (OTP: ``start_children`` stops at the first failure.)
- :class:`StopMany` stops its children concurrently (simple_one_for_one shutdown); every other
  stop is sequential, in the order given, which is reverse start order.
- :class:`ScheduleTryAgain` puts ``TryAgainRestart`` at the *back* of the event queue, so
  other requests are served between restart attempts, as OTP's ``try_again_restart`` cast.
- :class:`ScheduleRestart` puts ``RestartDue`` on the queue after ``delay_s`` (a child's
  ``restart_delay_s``, an erlay addition): the restart is counted and reported at the exit,
  the child is ``restarting`` meanwhile, and the supervisor serves other events.  A
  ``RestartDue`` starts the child only if that same restart is still pending (``restart``
  is the child's restart count when it was scheduled).
- :class:`Terminate` ends the supervisor with the given reason after the stops before it.

Events for an incarnation that is no longer current are ignored, so exits that race a plan
cannot cause a second restart.

Deviations from OTP are listed in :mod:`erlay.supervisor.spec` and :mod:`erlay.supervisor.runtime`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from erlay.supervisor.core_types import (
    Action,
    Boot,
    ChildExited,
    ChildRecord,
    ChildStatus,
    Context,
    Decision,
    DeleteChildCall,
    Event,
    Phase,
    Reply,
    Report,
    RestartChildCall,
    RestartDue,
    ScheduleRestart,
    ScheduleTryAgain,
    ShutdownCall,
    Start,
    StartChildCall,
    Started,
    StartFailed,
    Stop,
    StopMany,
    Stopped,
    SupervisorState,
    Terminate,
    TerminateChildCall,
    TryAgainRestart,
)
from erlay.supervisor.errors import InvalidSpec
from erlay.supervisor.events import EventKind
from erlay.supervisor.reason import ExitKind, ExitReason
from erlay.supervisor.spec import (
    AutoShutdown,
    ChildSpec,
    ChildType,
    Restart,
    ShutdownKind,
    Strategy,
    SupervisorFlags,
    validate_child,
    validate_children,
)

__all__ = [  # the vocabulary is re-exported: callers use core.<Name> for both
    "Action", "Boot", "ChildExited", "ChildInfo", "ChildRecord", "ChildStatus", "Context",
    "Decision", "DeleteChildCall", "Event", "Phase", "Reply", "Report", "RestartChildCall",
    "RestartDue", "ScheduleRestart", "ScheduleTryAgain", "ShutdownCall", "Start",
    "StartChildCall", "StartFailed", "Started", "Stop", "StopMany", "Stopped",
    "SupervisorState", "Terminate", "TerminateChildCall", "TryAgainRestart", "count_children",
    "decide", "init_state", "restart_wanted", "shutdown_error", "which_children",
    "within_intensity",
]


def init_state(path: str, flags: SupervisorFlags, specs: tuple[ChildSpec, ...]) -> SupervisorState:
    """Validate ``specs`` against ``flags`` and build the state of a supervisor not yet booted."""
    validate_children(flags, specs)
    if flags.strategy is Strategy.SIMPLE_ONE_FOR_ONE:
        return SupervisorState(path, flags, (), {}, template=specs[0])
    return SupervisorState(path, flags, tuple(s.id for s in specs),
                           {s.id: ChildRecord(s) for s in specs})



# ------------------------------------------------------------------------------ the decision

def decide(state: SupervisorState, event: Event, now: float) -> Decision:
    """Apply one event.  Pure: the same (state, event, now) always gives the same decision."""
    match event:
        case Boot():
            return _boot(state)
        case ChildExited():
            return _child_exited(state, event, now)
        case Started():
            return _started(state, event)
        case StartFailed():
            return _start_failed(state, event)
        case Stopped():
            return _stopped(state, event)
        case TryAgainRestart():
            rec = state.children.get(event.child_id)
            if state.phase is not Phase.RUNNING or rec is None \
                    or rec.status is not ChildStatus.RESTARTING:
                return Decision(state)
            return _restart(state, event.child_id, now)
        case RestartDue():
            rec = state.children.get(event.child_id)
            if state.phase is not Phase.RUNNING or rec is None \
                    or rec.status is not ChildStatus.RESTARTING or rec.restarts != event.restart:
                return Decision(state)   # terminated, deleted or restarted meanwhile
            start, state = _next_start(state, event.child_id, Context.RESTART)
            return Decision(state, (start,))
        case StartChildCall():
            return _start_child_call(state, event)
        case TerminateChildCall():
            return _terminate_child_call(state, event)
        case RestartChildCall():
            return _restart_child_call(state, event)
        case DeleteChildCall():
            return _delete_child_call(state, event)
        case ShutdownCall():
            if state.phase is Phase.TERMINATED:
                return Decision(state, (Reply(event.ref, True),))
            stops = _stop_all(state)
            state = replace(state, phase=Phase.TERMINATED, exit_reason=event.reason)
            return Decision(state, (Report(EventKind.SHUTDOWN, None, str(event.reason)),
                                    *stops, Terminate(event.reason), Reply(event.ref, True)))
    raise TypeError(f"unknown event {event!r}")


def restart_wanted(restart: Restart, reason: ExitReason) -> bool:
    """OTP's ``do_restart`` table: one row per (restart type, exit reason)."""
    match restart, reason.is_normal:
        case Restart.PERMANENT, _:
            return True
        case Restart.TRANSIENT, False:
            return True
        case Restart.TRANSIENT, True:
            return False
        case Restart.TEMPORARY, _:
            return False
    raise AssertionError("unreachable")


def shutdown_error(spec: ChildSpec, reason: ExitReason) -> bool:
    """True when a child stopped by its supervisor ended with an unexpected reason.

    OTP's ``shutdown/1``: ``killed`` is fine after brutal_kill; ``shutdown`` after a polite
    request; ``normal`` and ``{shutdown, _}`` for any non-permanent child.  A child that had
    to be killed after its timeout is reported.
    """
    permanent = spec.restart_type is Restart.PERMANENT
    match spec.shutdown_policy.kind, reason.kind:
        case ShutdownKind.BRUTAL_KILL, ExitKind.KILLED:
            return False
        case _, ExitKind.SHUTDOWN if reason.detail == "":
            return spec.shutdown_policy.kind is ShutdownKind.BRUTAL_KILL and permanent
        case _, ExitKind.SHUTDOWN | ExitKind.NORMAL:
            return permanent
    return True


def within_intensity(restarts: tuple[float, ...], now: float,
                     flags: SupervisorFlags) -> tuple[bool, tuple[float, ...]]:
    """OTP's ``add_restart``: record a restart at ``now``; False once more than ``intensity``
    restarts fall inside the last ``period`` seconds (inclusive, as OTP's ``>= Threshold``)."""
    threshold = now - flags.period
    kept = (now, *tuple(t for t in restarts if t >= threshold))
    return len(kept) <= flags.intensity, kept


# ---------------------------------------------------------------------------------- helpers

def _set(state: SupervisorState, child_id: str, **changes: Any) -> SupervisorState:
    children = dict(state.children)
    children[child_id] = replace(children[child_id], **changes)
    return replace(state, children=children)


def _remove(state: SupervisorState, child_id: str) -> SupervisorState:
    children = dict(state.children)
    children.pop(child_id, None)
    return replace(state, children=children,
                   order=tuple(c for c in state.order if c != child_id))


def _next_start(state: SupervisorState, child_id: str,
                context: Context, ref: Any = None) -> tuple[Start, SupervisorState]:
    # The incarnation is recorded only when the start's outcome comes back, so starts that a
    # failed plan never reached do not consume a number.
    inc = state.children[child_id].incarnation + 1
    return Start(child_id, inc, context, ref), state


def _stop_all(state: SupervisorState) -> tuple[Action, ...]:
    """Stops for every running child: reverse start order, or all at once for simple."""
    running = [(cid, r.incarnation) for cid, r in state.children.items()
               if r.status is ChildStatus.RUNNING]
    if state.is_simple:
        return (StopMany(tuple(running)),) if running else ()
    by_id = dict(running)
    return tuple(Stop(cid, by_id[cid]) for cid in reversed(state.order) if cid in by_id)


def _shutdown_plan(state: SupervisorState, reason: ExitReason,
                   report: Report) -> Decision:
    stops = _stop_all(state)
    state = replace(state, phase=Phase.TERMINATED, exit_reason=reason)
    return Decision(state, (report, *stops, Terminate(reason)))


# ------------------------------------------------------------------------------- transitions

def _boot(state: SupervisorState) -> Decision:
    if state.phase is not Phase.NEW:
        return Decision(state)
    state = replace(state, phase=Phase.RUNNING)
    plan: list[Action] = []
    for cid in state.order:
        start, state = _next_start(state, cid, Context.BOOT)
        plan.append(start)
    return Decision(state, tuple(plan))


def _started(state: SupervisorState, ev: Started) -> Decision:
    rec = state.children.get(ev.child_id)
    if rec is None:
        return Decision(state)
    state = _set(state, ev.child_id, status=ChildStatus.RUNNING, incarnation=ev.incarnation)
    actions: list[Action] = [Report(EventKind.START, ev.child_id, "started",
                                    attempt=rec.restarts)]
    if ev.context in (Context.START_CHILD, Context.RESTART_CHILD):
        actions.append(Reply(ev.ref, True, ev.child_id))
    return Decision(state, tuple(actions))


def _start_failed(state: SupervisorState, ev: StartFailed) -> Decision:
    rec = state.children.get(ev.child_id)
    if rec is None:
        return Decision(state)
    state = _set(state, ev.child_id, incarnation=ev.incarnation)
    report = Report(EventKind.START_ERROR, ev.child_id, ev.reason, attempt=rec.restarts)
    match ev.context:
        case Context.BOOT:
            reason = ExitReason(ExitKind.SHUTDOWN,
                                f"failed_to_start_child {ev.child_id}: {ev.reason}",
                                offender=state.child_path(ev.child_id))
            return _shutdown_plan(state, reason, report)
        case Context.RESTART:
            state = _set(state, ev.child_id, status=ChildStatus.RESTARTING)
            return Decision(state, (report, ScheduleTryAgain(ev.child_id)))
        case Context.START_CHILD:
            state = _remove(state, ev.child_id)
            return Decision(state, (report, Reply(ev.ref, False, ev.reason)))
        case Context.RESTART_CHILD:
            return Decision(state, (report, Reply(ev.ref, False, ev.reason)))
    raise AssertionError("unreachable")


def _stopped(state: SupervisorState, ev: Stopped) -> Decision:
    rec = state.children.get(ev.child_id)
    if rec is None:
        return Decision(state)
    actions: tuple[Action, ...] = ()
    if shutdown_error(rec.spec, ev.reason):
        actions = (Report(EventKind.SHUTDOWN_ERROR, ev.child_id, str(ev.reason),
                          attempt=rec.restarts),)
    if ev.remove:
        return Decision(_remove(state, ev.child_id), actions)
    state = _set(state, ev.child_id, status=ChildStatus.UNDEFINED, last_exit=ev.reason)
    return Decision(state, actions)


def _child_exited(state: SupervisorState, ev: ChildExited, now: float) -> Decision:
    rec = state.children.get(ev.child_id)
    if state.phase is not Phase.RUNNING or rec is None \
            or rec.status is not ChildStatus.RUNNING or rec.incarnation != ev.incarnation:
        return Decision(state)  # stale: an older incarnation, or already handled
    exit_report = Report(EventKind.EXIT, ev.child_id, str(ev.reason), attempt=rec.restarts)
    state = _set(state, ev.child_id, status=ChildStatus.UNDEFINED, last_exit=ev.reason)
    if restart_wanted(rec.spec.restart_type, ev.reason):
        decision = _restart(state, ev.child_id, now)
        return Decision(decision.state, (exit_report, *decision.actions))
    if state.is_simple or rec.spec.restart_type is Restart.TEMPORARY:
        state = _remove(state, ev.child_id)
    decision = _auto_shutdown(state, rec.spec)
    return Decision(decision.state, (exit_report, *decision.actions))


def _auto_shutdown(state: SupervisorState, spec: ChildSpec) -> Decision:
    """OTP's ``do_auto_shutdown``, for a significant child that ended by itself."""
    match state.flags.auto_shutdown:
        case AutoShutdown.NEVER:
            return Decision(state)
        case _ if not spec.significant:
            return Decision(state)
        case AutoShutdown.ANY_SIGNIFICANT:
            pass
        case AutoShutdown.ALL_SIGNIFICANT:
            if any(r.spec.significant and r.status is not ChildStatus.UNDEFINED
                   for r in state.children.values()):
                return Decision(state)
    reason = ExitReason(ExitKind.SHUTDOWN, "auto_shutdown")
    return _shutdown_plan(state, reason,
                          Report(EventKind.SHUTDOWN, spec.id, "auto_shutdown: significant "
                                 f"child {spec.id} terminated"))


def _restart(state: SupervisorState, child_id: str, now: float) -> Decision:
    """OTP's ``restart/2``: count the restart, give up past the intensity, else re-plan."""
    rec = state.children[child_id]
    ok, restarts = within_intensity(state.restarts, now, state.flags)
    state = replace(state, restarts=restarts)
    if not ok:
        flags = state.flags
        reason = ExitReason(
            ExitKind.SHUTDOWN, "reached_max_restart_intensity "
            f"({flags.intensity} restart(s) in {flags.period:g} s)",
            offender=state.child_path(child_id), cause=rec.last_exit)
        if rec.spec.restart_type is Restart.TEMPORARY or state.is_simple:
            state = _remove(state, child_id)
        else:
            state = _set(state, child_id, status=ChildStatus.UNDEFINED)
        return _shutdown_plan(state, reason,
                              Report(EventKind.ESCALATION, child_id, str(reason),
                                     attempt=len(restarts)))
    state = _set(state, child_id, restarts=rec.restarts + 1, status=ChildStatus.UNDEFINED)
    report = Report(EventKind.RESTART, child_id, str(rec.last_exit), attempt=rec.restarts + 1)
    match state.strategy:
        case Strategy.ONE_FOR_ONE | Strategy.SIMPLE_ONE_FOR_ONE:
            if rec.spec.restart_delay_s > 0:
                state = _set(state, child_id, status=ChildStatus.RESTARTING)
                return Decision(state, (report, ScheduleRestart(
                    child_id, rec.spec.restart_delay_s, rec.restarts + 1)))
            start, state = _next_start(state, child_id, Context.RESTART)
            return Decision(state, (report, start))
        case Strategy.ONE_FOR_ALL:
            affected = state.order
        case Strategy.REST_FOR_ONE:
            affected = state.order[state.order.index(child_id):]
    return _restart_several(state, affected, report)


def _restart_several(state: SupervisorState, affected: tuple[str, ...],
                     report: Report) -> Decision:
    """Stop ``affected`` in reverse start order, then start the non-temporary ones in order.

    Temporary children are stopped and forgotten: OTP never restarts them, even when a
    sibling's restart is what terminated them.
    """
    plan: list[Action] = [report]
    for cid in reversed(affected):
        rec = state.children[cid]
        temporary = rec.spec.restart_type is Restart.TEMPORARY
        if rec.status is ChildStatus.RUNNING:
            plan.append(Stop(cid, rec.incarnation, remove=temporary))
        elif temporary:
            state = _remove(state, cid)
    for cid in affected:
        if cid in state.children and \
                state.children[cid].spec.restart_type is not Restart.TEMPORARY:
            start, state = _next_start(state, cid, Context.RESTART)
            plan.append(start)
    return Decision(state, tuple(plan))


# ------------------------------------------------------------------------- the dynamic API

def _refuse(ref: Any, reason: str) -> tuple[Action, ...]:
    return (Reply(ref, False, reason),)


def _start_child_call(state: SupervisorState, ev: StartChildCall) -> Decision:
    if state.phase is not Phase.RUNNING:
        return Decision(state, _refuse(ev.ref, "terminated"))
    if state.is_simple:
        assert state.template is not None
        cid = f"{state.template.id}-{state.next_instance}"
        children = dict(state.children)
        children[cid] = ChildRecord(state.template, args=tuple(ev.args))
        state = replace(state, children=children, order=(*state.order, cid),
                        next_instance=state.next_instance + 1)
        start, state = _next_start(state, cid, Context.START_CHILD, ev.ref)
        return Decision(state, (start,))
    if ev.spec is None:
        return Decision(state, _refuse(ev.ref, "not_simple_one_for_one"))
    try:
        validate_child(state.flags, ev.spec)
    except InvalidSpec as exc:
        return Decision(state, _refuse(ev.ref, f"invalid_child_spec: {exc}"))
    existing = state.children.get(ev.spec.id)
    if existing is not None:
        running = existing.status is not ChildStatus.UNDEFINED
        return Decision(state, _refuse(ev.ref, "already_started" if running
                                       else "already_present"))
    children = dict(state.children)
    children[ev.spec.id] = ChildRecord(ev.spec)
    state = replace(state, children=children, order=(*state.order, ev.spec.id))
    start, state = _next_start(state, ev.spec.id, Context.START_CHILD, ev.ref)
    return Decision(state, (start,))


def _terminate_child_call(state: SupervisorState, ev: TerminateChildCall) -> Decision:
    if state.is_simple and state.template is not None and ev.child_id == state.template.id:
        return Decision(state, _refuse(ev.ref, "simple_one_for_one"))
    rec = state.children.get(ev.child_id)
    if rec is None:
        return Decision(state, _refuse(ev.ref, "not_found"))
    remove = state.is_simple or rec.spec.restart_type is Restart.TEMPORARY
    if rec.status is ChildStatus.RUNNING:
        return Decision(state, (Stop(ev.child_id, rec.incarnation, remove=remove),
                                Reply(ev.ref, True)))
    # Not running (or between restart attempts): cancel any pending restart.
    state = _remove(state, ev.child_id) if remove else \
        _set(state, ev.child_id, status=ChildStatus.UNDEFINED)
    return Decision(state, (Reply(ev.ref, True),))


def _restart_child_call(state: SupervisorState, ev: RestartChildCall) -> Decision:
    if state.is_simple:
        return Decision(state, _refuse(ev.ref, "simple_one_for_one"))
    rec = state.children.get(ev.child_id)
    if rec is None:
        return Decision(state, _refuse(ev.ref, "not_found"))
    match rec.status:
        case ChildStatus.RUNNING:
            return Decision(state, _refuse(ev.ref, "running"))
        case ChildStatus.RESTARTING:
            return Decision(state, _refuse(ev.ref, "restarting"))
        case ChildStatus.UNDEFINED:
            start, state = _next_start(state, ev.child_id, Context.RESTART_CHILD, ev.ref)
            return Decision(state, (start,))
    raise AssertionError("unreachable")


def _delete_child_call(state: SupervisorState, ev: DeleteChildCall) -> Decision:
    if state.is_simple:
        return Decision(state, _refuse(ev.ref, "simple_one_for_one"))
    rec = state.children.get(ev.child_id)
    if rec is None:
        return Decision(state, _refuse(ev.ref, "not_found"))
    match rec.status:
        case ChildStatus.RUNNING:
            return Decision(state, _refuse(ev.ref, "running"))
        case ChildStatus.RESTARTING:
            return Decision(state, _refuse(ev.ref, "restarting"))
        case ChildStatus.UNDEFINED:
            return Decision(_remove(state, ev.child_id), (Reply(ev.ref, True),))
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------- queries

@dataclass(frozen=True)
class ChildInfo:
    """One row of ``which_children``: OTP's (Id, Child, Type, Modules) plus erlay's counters."""

    id: str
    status: ChildStatus
    type: ChildType
    incarnation: int
    restarts: int
    last_exit: ExitReason | None


def which_children(state: SupervisorState) -> list[ChildInfo]:
    """Children in start order."""
    return [ChildInfo(cid, r.status, r.spec.child_type, r.incarnation, r.restarts, r.last_exit)
            for cid in state.order if (r := state.children.get(cid)) is not None]


def count_children(state: SupervisorState) -> dict[str, int]:
    """OTP's ``count_children``: specs, active, supervisors, workers."""
    active = sum(r.status is ChildStatus.RUNNING for r in state.children.values())
    supers = sum(r.spec.child_type is ChildType.SUPERVISOR for r in state.children.values())
    if state.is_simple:
        return {"specs": 1, "active": active, "supervisors": supers,
                "workers": len(state.children) - supers}
    return {"specs": len(state.children), "active": active, "supervisors": supers,
            "workers": len(state.children) - supers}

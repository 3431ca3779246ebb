"""The supervisor core's vocabulary: child and supervisor state, the events that
:func:`erlay.supervisor.core.decide` takes and the actions its plans hold.

All frozen data, no behaviour beyond derived properties; the decisions and the plan contract
are in :mod:`erlay.supervisor.core`, which re-exports every name here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from erlay.supervisor.events import EventKind
from erlay.supervisor.reason import ExitKind, ExitReason
from erlay.supervisor.spec import ChildSpec, Strategy, SupervisorFlags


class ChildStatus(enum.Enum):
    RUNNING = "running"        # an incarnation is alive
    RESTARTING = "restarting"  # a restart is scheduled: a delayed one, or a failed one's retry
    UNDEFINED = "undefined"    # no incarnation (OTP: pid undefined)


class Context(enum.Enum):
    """Why a start was asked for; it decides what a failure means."""

    BOOT = "boot"
    RESTART = "restart"
    START_CHILD = "start_child"
    RESTART_CHILD = "restart_child"


class Phase(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    TERMINATED = "terminated"


@dataclass(frozen=True)
class ChildRecord:
    spec: ChildSpec
    status: ChildStatus = ChildStatus.UNDEFINED
    incarnation: int = 0      # number of the latest start attempt; 0 = never started
    args: tuple[Any, ...] = ()  # extra start args of a simple_one_for_one instance
    restarts: int = 0         # restarts this supervisor made of this child
    last_exit: ExitReason | None = None


@dataclass(frozen=True)
class SupervisorState:
    path: str
    flags: SupervisorFlags
    order: tuple[str, ...]                 # child ids in start order
    children: Mapping[str, ChildRecord]    # never mutated in place
    template: ChildSpec | None = None      # simple_one_for_one only
    restarts: tuple[float, ...] = ()       # restart times inside the period, newest first
    phase: Phase = Phase.NEW
    next_instance: int = 1
    exit_reason: ExitReason | None = None

    @property
    def strategy(self) -> Strategy:
        return self.flags.strategy  # type: ignore[return-value]

    @property
    def is_simple(self) -> bool:
        return self.strategy is Strategy.SIMPLE_ONE_FOR_ONE

    def child_path(self, child_id: str) -> str:
        return f"{self.path}/{child_id}"


# ---------------------------------------------------------------------------- events (input)

@dataclass(frozen=True)
class Boot:
    pass


@dataclass(frozen=True)
class ChildExited:
    child_id: str
    incarnation: int
    reason: ExitReason


@dataclass(frozen=True)
class Started:
    child_id: str
    incarnation: int
    context: Context
    ref: Any = None


@dataclass(frozen=True)
class StartFailed:
    child_id: str
    incarnation: int
    reason: str
    context: Context
    ref: Any = None


@dataclass(frozen=True)
class Stopped:
    child_id: str
    incarnation: int
    reason: ExitReason
    remove: bool = False


@dataclass(frozen=True)
class TryAgainRestart:
    child_id: str


@dataclass(frozen=True)
class RestartDue:
    child_id: str
    restart: int           # the child's restart count when it was scheduled


@dataclass(frozen=True)
class StartChildCall:
    ref: Any
    spec: ChildSpec | None = None          # static strategies
    args: tuple[Any, ...] = ()             # simple_one_for_one


@dataclass(frozen=True)
class TerminateChildCall:
    ref: Any
    child_id: str


@dataclass(frozen=True)
class RestartChildCall:
    ref: Any
    child_id: str


@dataclass(frozen=True)
class DeleteChildCall:
    ref: Any
    child_id: str


@dataclass(frozen=True)
class ShutdownCall:
    ref: Any
    reason: ExitReason = field(default_factory=lambda: ExitReason(ExitKind.SHUTDOWN))


Event = (Boot | ChildExited | Started | StartFailed | Stopped | TryAgainRestart | RestartDue
         | StartChildCall | TerminateChildCall | RestartChildCall | DeleteChildCall | ShutdownCall)


# --------------------------------------------------------------------------- actions (output)

@dataclass(frozen=True)
class Start:
    child_id: str
    incarnation: int
    context: Context
    ref: Any = None


@dataclass(frozen=True)
class Stop:
    child_id: str
    incarnation: int
    remove: bool = False   # forget the child once stopped (temporary children)


@dataclass(frozen=True)
class StopMany:
    children: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Report:
    kind: EventKind
    child_id: str | None
    reason: str
    attempt: int = 0


@dataclass(frozen=True)
class Reply:
    ref: Any
    ok: bool
    value: Any = None      # child id on success, OTP error atom on failure


@dataclass(frozen=True)
class ScheduleTryAgain:
    child_id: str


@dataclass(frozen=True)
class ScheduleRestart:
    child_id: str
    delay_s: float
    restart: int


@dataclass(frozen=True)
class Terminate:
    reason: ExitReason


Action = (Start | Stop | StopMany | Report | Reply | ScheduleTryAgain | ScheduleRestart
          | Terminate)


@dataclass(frozen=True)
class Decision:
    state: SupervisorState
    actions: tuple[Action, ...] = ()

"""The one structured event every supervisor emits, and where events go.

Every start, exit, restart, escalation and shutdown error produces exactly one
:class:`SupervisorEvent` with fixed fields, like OTP's supervisor report (supervisor, context,
reason, offender).  Sinks fan the same event out: to ``logging``, to a JSONL file (the run's
``events.jsonl``), to memory for tests, and to whatever later layers register (OpenTelemetry,
Ray metrics).  A sink that fails is logged and skipped; it never takes the supervisor down.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("erlay.supervisor")


class EventKind(enum.Enum):
    """The ``context`` of an event.  OTP's error contexts keep OTP's names."""

    START = "start"                    # a child incarnation is up (OTP: progress report)
    START_ERROR = "start_error"        # a start failed
    EXIT = "exit"                      # a child incarnation ended (OTP: child_terminated)
    RESTART = "restart"                # the supervisor decided to restart after an exit
    ESCALATION = "escalation"          # restart intensity exceeded; the supervisor gives up
    SHUTDOWN_ERROR = "shutdown_error"  # a child did not stop the way it was asked to
    SHUTDOWN = "shutdown"              # a supervisor stops (requested or auto_shutdown)
    HANG = "hang"                      # a progress deadline passed; the child is killed
    QUARANTINE = "quarantine"          # a child is unreachable and being probed
    RECOVERED = "recovered"            # a quarantined child answered again
    REPLACED = "replaced"              # a worker's process replaced in place: a call froze
                                       # or killed it (erlay.supervisor.worker_process)
    SAVE_FAILED = "save_failed"        # a child's checkpoint save was given up (its writer
                                       # made no progress, or failed); the child runs on
    CONTROL = "control"                # the goodput controller acted (routed, hedged,
                                       # restarted, adapted a limit), with its reason


_LEVELS = {EventKind.START: logging.INFO, EventKind.SHUTDOWN: logging.INFO,
           EventKind.RECOVERED: logging.INFO, EventKind.RESTART: logging.WARNING,
           EventKind.EXIT: logging.WARNING, EventKind.QUARANTINE: logging.WARNING,
           EventKind.REPLACED: logging.WARNING, EventKind.SAVE_FAILED: logging.WARNING,
           EventKind.CONTROL: logging.INFO}


@dataclass(frozen=True)
class SupervisorEvent:
    """One fact about the tree.  ``time`` is wall-clock seconds since the epoch.

    ``extra`` holds optional context (pid, node, latency) that never replaces a fixed field.
    """

    supervisor: str
    child: str | None
    context: EventKind
    reason: str
    attempt: int
    time: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return f"{self.supervisor}/{self.child}" if self.child else self.supervisor

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["context"] = self.context.value
        return data

    @staticmethod
    def from_dict(data: dict[str, Any]) -> SupervisorEvent:
        return SupervisorEvent(data["supervisor"], data.get("child"), EventKind(data["context"]),
                               data.get("reason", ""), int(data.get("attempt", 0)),
                               float(data["time"]), dict(data.get("extra") or {}))


class EventSink(Protocol):
    def emit(self, event: SupervisorEvent) -> None: ...


class LoggingSink:
    """Writes each event as one log line on the ``erlay.supervisor`` logger."""

    def emit(self, event: SupervisorEvent) -> None:
        level = _LEVELS.get(event.context, logging.ERROR)
        log.log(level, "supervisor=%s child=%s context=%s reason=%s attempt=%d",
                event.supervisor, event.child, event.context.value, event.reason,
                event.attempt)


class JsonlSink:
    """Appends events to a JSONL file, one object per line, flushed per event.

    Flushing (not fsyncing) per event keeps a crashed run's file readable up to its last
    event without paying a disk sync per restart.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open
        self._lock = threading.Lock()

    def emit(self, event: SupervisorEvent) -> None:
        line = json.dumps(event.to_dict(), default=str)
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class MemorySink:
    """Keeps the last ``maxlen`` events; used by hosts (drained by the parent) and tests."""

    def __init__(self, maxlen: int = 10_000) -> None:
        self.events: deque[SupervisorEvent] = deque(maxlen=maxlen)
        self.total = 0
        self._lock = threading.Lock()

    def emit(self, event: SupervisorEvent) -> None:
        with self._lock:
            self.events.append(event)
            self.total += 1

    def since(self, cursor: int) -> tuple[list[SupervisorEvent], int]:
        """Events numbered >= ``cursor`` (numbering counts every event ever emitted)."""
        with self._lock:
            first = self.total - len(self.events)
            start = max(cursor, first)
            return list(self.events)[start - first:], self.total

    def of(self, kind: EventKind) -> list[SupervisorEvent]:
        with self._lock:
            return [e for e in self.events if e.context is kind]


class FanoutSink:
    """Sends every event to each sink; a failing sink is logged and never propagates."""

    def __init__(self, sinks: Iterable[EventSink] = ()) -> None:
        self.sinks: list[EventSink] = list(sinks)

    def add(self, sink: EventSink) -> None:
        self.sinks.append(sink)

    def emit(self, event: SupervisorEvent) -> None:
        for sink in self.sinks:
            try:
                sink.emit(event)
            except Exception:
                log.exception("event sink %r failed", sink)


class CallbackSink:
    """Calls ``fn(event)``; a convenience for wiring events into other layers."""

    def __init__(self, fn: Callable[[SupervisorEvent], None]) -> None:
        self.fn = fn

    def emit(self, event: SupervisorEvent) -> None:
        self.fn(event)


def read_events(path: str | os.PathLike[str]) -> list[SupervisorEvent]:
    """Read an events.jsonl file, skipping a torn last line left by a crash."""
    out: list[SupervisorEvent] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(SupervisorEvent.from_dict(json.loads(line)))
            except (json.JSONDecodeError, KeyError, ValueError):
                continue
    return out

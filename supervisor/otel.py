"""Supervisor events as OpenTelemetry spans: failures, restarts and escalations.

:class:`TracingEventSink` is an :class:`~erlay.supervisor.events.EventSink`.  For each child it
turns

- an abnormal ``exit`` or a ``start_error`` into a ``failure`` span (an instant),
- a ``restart`` decision into a ``restart`` span that ends when that child's next incarnation
  is up (``start``) or fails to start, *linked* to the failure that caused it,
- an ``escalation`` into an ``escalation`` span linked to the last failure below that
  supervisor, so a trace viewer walks from a job that gave up to the leaf that started it.

Attributes: ``erlay.path``, ``erlay.domain``, ``erlay.cause``, ``erlay.reason`` and
``erlay.attempt``.  The tracer is fetched per event (``tracer_fn``), so the sink follows a
process whose telemetry is configured after the tree started.  Pure helpers
(:func:`domain_of`, :func:`cause_of`, :func:`is_failure`) are shared with reports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, Status, StatusCode

from erlay.supervisor.events import EventKind, SupervisorEvent

_NORMAL = ("normal", "shutdown")


def domain_of(path: str) -> str:
    """The fault domain of a tree path: its component below the root (``erlay/sandbox/
    host@node-0/sandbox-2`` -> ``sandbox``); ``root`` for the root itself."""
    parts = path.split("/")
    return parts[1] if len(parts) > 1 else "root"


def is_failure(event: SupervisorEvent) -> bool:
    """An abnormal exit or a failed start: what restart intensity counts."""
    if event.context is EventKind.START_ERROR:
        return True
    return event.context is EventKind.EXIT and not event.reason.startswith(_NORMAL)


def cause_of(event: SupervisorEvent) -> str:
    """The kind of a failure: ``killed``, ``error``, ``hang``, ``lost`` (an exit reason's
    kind, see :mod:`erlay.supervisor.reason`) or ``start_error``."""
    if event.context is EventKind.START_ERROR:
        return "start_error"
    return event.reason.split(":", 1)[0].split(" ", 1)[0] or "unknown"


class TracingEventSink:
    """See the module docstring.  Thread-safe; never raises into the supervisor (the
    :class:`~erlay.supervisor.events.FanoutSink` it sits in logs and skips a failing sink)."""

    def __init__(self, tracer_fn: Callable[[], trace.Tracer],
                 on_restart: Callable[[str, str], None] | None = None) -> None:
        self._tracer_fn = tracer_fn
        self._on_restart = on_restart
        self._lock = threading.Lock()
        self._failures: dict[str, SpanContext] = {}     # child path -> its last failure
        self._causes: dict[str, str] = {}               # child path -> that failure's cause
        self._restarts: dict[str, Span] = {}            # child path -> open restart span

    def emit(self, event: SupervisorEvent) -> None:
        if event.child is None:
            return
        path = event.path
        base = {"erlay.path": path, "erlay.domain": domain_of(path),
                "erlay.reason": event.reason[:500], "erlay.attempt": event.attempt}
        ns = int(event.time * 1e9)
        tracer = self._tracer_fn()
        with self._lock:
            if is_failure(event):
                cause = cause_of(event)
                span = tracer.start_span("failure", start_time=ns,
                                         attributes={**base, "erlay.cause": cause})
                span.set_status(Status(StatusCode.ERROR, event.reason[:200]))
                span.end(end_time=ns)
                self._failures[path] = span.get_span_context()
                self._causes[path] = cause
                self._end_restart(path, ns, ok=False)
            elif event.context is EventKind.RESTART:
                cause = self._causes.get(path, "unknown")
                self._end_restart(path, ns, ok=False)
                self._restarts[path] = tracer.start_span(
                    "restart", start_time=ns, links=self._link(path),
                    attributes={**base, "erlay.cause": cause})
                if self._on_restart is not None:
                    self._on_restart(domain_of(path), cause)
            elif event.context is EventKind.START:
                self._end_restart(path, ns, ok=True)
            elif event.context is EventKind.CONTROL:
                # One span per goodput-controller action, its reason and numbers attached.
                extra = {f"erlay.control.{k}": v for k, v in event.extra.items()
                         if isinstance(v, str | int | float | bool)}
                tracer.start_span("control", start_time=ns,
                                  attributes={**base, **extra}).end(end_time=ns)
            elif event.context is EventKind.ESCALATION:
                below = [c for p, c in self._failures.items() if p.startswith(path + "/")
                         or p == path]
                span = tracer.start_span("escalation", start_time=ns,
                                         links=[Link(below[-1])] if below else [],
                                         attributes=base)
                span.set_status(Status(StatusCode.ERROR, event.reason[:200]))
                span.end(end_time=ns)

    def _link(self, path: str) -> list[Link]:
        failure = self._failures.get(path)
        return [Link(failure)] if failure is not None else []

    def _end_restart(self, path: str, ns: int, *, ok: bool) -> None:
        span = self._restarts.pop(path, None)
        if span is None:
            return
        if not ok:
            span.set_status(Status(StatusCode.ERROR, "the new incarnation did not start"))
        span.end(end_time=ns)

"""Failure attribution: which fault domain cost the run what.

Pure functions over a run's parsed supervisor events and metrics records; no I/O and no
plotting (:mod:`erlay.actors.observe.report` does both).  The definitions, which the report
restates:

- A *failure* is an abnormal exit (any reason but ``normal`` / ``shutdown``), a
  ``start_error`` or a ``hang``.  A hang and the exit of the kill it causes are one failure,
  dated at the hang.
- Its *domain* is the path component after the root (``erlay/sandbox/host@node-0`` +
  ``sandbox-1`` is ``sandbox``); a path outside the five domains is ``other``.  Its *cause*
  is the exit reason's kind (:class:`Cause`).
- Its *recovery time* runs from the failure to the next start of the same child
  (supervisor path and child id).  A failure with no later start was not restarted before
  the run ended; it is counted apart and left out of mean recovery times.
- Its *time lost*: an RL step's window is the wall time since the previous RL step was
  recorded (the first step's window, and the first of a ``--resume``d driver run, is its own
  ``step_s``: no window spans an outage).  A step whose window holds
  failures cost the excess of its window over the median window of the steps that hold
  none (clipped at 0); the excess is split equally among its failures.  Failures outside
  every RL step window cost nothing here.  Percentages are of the total RL wall time (the
  sum of the windows).  Time lost is not goodput (:mod:`erlay.actors.observe.goodput`,
  trained tokens per second): it is what failures cost in wall time.
"""

from __future__ import annotations

import enum
import re
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from erlay.supervisor.events import EventKind, SupervisorEvent

DOMAINS = ("learner", "generation", "sandbox", "judge", "environment", "rollout")
OTHER = "other"


class Cause(enum.Enum):
    """Why a child failed: an abnormal exit's kind, or how the supervisor saw it fail."""

    KILLED = "killed"
    ERROR = "error"
    HANG = "hang"
    LOST = "lost"
    START_ERROR = "start_error"
    UNKNOWN = "unknown"  # an exit reason this version cannot parse


@dataclass(frozen=True)
class Failure:
    """One failure of one child.  ``time`` and ``recovered_at`` are unix seconds."""

    time: float
    supervisor: str
    child: str | None
    domain: str
    cause: Cause
    reason: str
    recovered_at: float | None = None

    @property
    def path(self) -> str:
        return f"{self.supervisor}/{self.child}" if self.child else self.supervisor

    @property
    def recovery_s(self) -> float | None:
        """Seconds until the child's next start; None if it was never started again."""
        return None if self.recovered_at is None else self.recovered_at - self.time


@dataclass(frozen=True)
class StepWindow:
    """The wall time an RL step accounts for, in seconds since the job start."""

    step: int
    start: float
    end: float

    @property
    def wall_s(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass(frozen=True)
class TimeLost:
    """Time lost to each failure (seconds, in the order given) and what it rests on."""

    costs: tuple[float, ...]
    rl_wall_s: float
    baseline_s: float | None  # the median window of failure-free steps
    steps_hit: int            # RL steps whose window holds at least one failure
    outside: int              # failures outside every RL step window


@dataclass(frozen=True)
class AttributionRow:
    """One line of the attribution table; ``cause`` is None on a per-domain line."""

    domain: str
    cause: Cause | None
    failures: int
    share_pct: float
    mean_recovery_s: float | None
    unrecovered: int
    cost_s: float           # time lost, seconds
    cost_pct: float | None  # of RL wall time; None when no RL step was recorded


def domain_of(supervisor: str, child: str | None) -> str:
    """The fault domain of a child: the path component after the root, or ``other``."""
    parts = [p for p in supervisor.split("/") if p]
    if child:
        parts.append(child)
    if len(parts) < 2:
        return OTHER
    return parts[1] if parts[1] in DOMAINS else OTHER


_KINDS = {"killed": Cause.KILLED, "error": Cause.ERROR, "hang": Cause.HANG,
          "lost": Cause.LOST}
_NORMAL = frozenset({"normal", "shutdown"})
_HEAD = re.compile(r"\s*([A-Za-z_]+)")


def exit_cause(reason: str) -> Cause | None:
    """The cause of an exit with this reason text (``str(ExitReason)``); None if normal."""
    match = _HEAD.match(reason)
    head = match.group(1).lower() if match else ""
    if head in _NORMAL:
        return None
    return _KINDS.get(head, Cause.UNKNOWN)


def failures_from_events(events: Sequence[SupervisorEvent]) -> list[Failure]:
    """The failures in ``events``, in time order, each with its ``recovered_at`` set."""
    out: list[Failure] = []
    waiting: dict[str, list[int]] = defaultdict(list)  # path -> failures not yet restarted
    hung: set[str] = set()  # paths killed for a hang whose exit has not arrived
    for event in sorted(events, key=lambda e: e.time):
        path = event.path
        match event.context:
            case EventKind.START:
                for i in waiting.pop(path, []):
                    out[i] = replace(out[i], recovered_at=event.time)
                hung.discard(path)
                continue
            case EventKind.HANG:
                cause: Cause | None = Cause.HANG
                hung.add(path)
            case EventKind.START_ERROR:
                cause = Cause.START_ERROR
            case EventKind.EXIT:
                cause = exit_cause(event.reason)
                if cause is not None and path in hung:
                    hung.discard(path)  # the kill that answered the hang: same failure
                    continue
            case _:
                cause = None
        if cause is None:
            continue
        waiting[path].append(len(out))
        out.append(Failure(event.time, event.supervisor, event.child,
                           domain_of(event.supervisor, event.child), cause, event.reason))
    return out


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def job_start(metrics: Sequence[Mapping[str, Any]], events: Sequence[SupervisorEvent],
              recorded: float | None = None) -> tuple[float | None, str]:
    """The job's start in unix seconds (the zero of metrics ``time``) and where it came from.

    In order: a ``started_at`` field of a metrics record, ``recorded`` (e.g. a chaos
    report's ``started_at``), else the first supervisor event, which comes after Ray's
    start-up and so is late by that much.  ``(None, ...)`` when there is nothing to go by."""
    for record in metrics:
        started = _num(record.get("started_at"))
        if started is not None:
            return started, "metrics.jsonl started_at"
    if recorded is not None:
        return recorded, "chaos-report.json started_at"
    if events:
        return (min(e.time for e in events),
                "estimated: the first supervisor event (metrics.jsonl records no started_at); "
                "failure times may be late against step times by Ray's start-up time")
    return None, "unknown: no started_at and no supervisor events"


def step_windows(rl: Sequence[Mapping[str, Any]], start: float | None) -> list[StepWindow]:
    """Each RL record's window in seconds since the job start ``start``.

    A record carrying its own ``started_at`` (a resumed segment) is shifted onto ``start``.
    A step starts where the previous one was recorded; the first step, the first of a
    resumed driver run (another ``started_at``: no window spans the outage between two
    runs), and one whose time goes backwards (a resume without ``started_at``), start
    ``step_s`` before their end."""
    out: list[StepWindow] = []
    prev: float | None = None
    prev_own: float | None = None
    for record in rl:
        end = _num(record.get("time"))
        if end is None:
            continue
        own = _num(record.get("started_at"))
        if own is not None and start is not None:
            end += own - start
        step_s = max(0.0, _num(record.get("step_s")) or 0.0)
        same_run = own is None or prev_own is None or own == prev_own
        begin = prev if prev is not None and prev < end and same_run else end - step_s
        step = record.get("step")
        out.append(StepWindow(step if isinstance(step, int) else len(out), begin, end))
        prev, prev_own = end, own if own is not None else prev_own
    return out


def time_lost(failures: Sequence[Failure], windows: Sequence[StepWindow],
              start: float | None) -> TimeLost:
    """The time lost to each failure (see the module docstring for the definition)."""
    hits: dict[int, list[int]] = defaultdict(list)
    outside = 0
    for i, failure in enumerate(failures):
        at = None if start is None else failure.time - start
        found = next((w for w, win in enumerate(windows)
                      if at is not None and win.start < at <= win.end), None)
        if found is None:
            outside += 1
        else:
            hits[found].append(i)
    clean = [win.wall_s for w, win in enumerate(windows) if w not in hits]
    baseline = (statistics.median(clean) if clean else
                min((win.wall_s for win in windows), default=None))
    costs = [0.0] * len(failures)
    for w, members in hits.items():
        excess = max(0.0, windows[w].wall_s - (baseline or 0.0))
        for i in members:
            costs[i] = excess / len(members)
    return TimeLost(tuple(costs), sum(win.wall_s for win in windows), baseline, len(hits),
                    outside)


def _row(domain: str, cause: Cause | None, members: list[int], failures: Sequence[Failure],
         lost: TimeLost) -> AttributionRow:
    recoveries = [r for i in members if (r := failures[i].recovery_s) is not None]
    cost = sum(lost.costs[i] for i in members)
    return AttributionRow(
        domain, cause, len(members), 100.0 * len(members) / len(failures),
        statistics.fmean(recoveries) if recoveries else None,
        len(members) - len(recoveries), cost,
        100.0 * cost / lost.rl_wall_s if lost.rl_wall_s > 0 else None)


def _order(domain: str) -> int:
    return DOMAINS.index(domain) if domain in DOMAINS else len(DOMAINS)


def attribution_rows(failures: Sequence[Failure], lost: TimeLost) -> list[AttributionRow]:
    """One row per (domain, cause) that failed: most failures first, then domain order,
    then :class:`Cause` order."""
    groups: dict[tuple[str, Cause], list[int]] = defaultdict(list)
    for i, failure in enumerate(failures):
        groups[(failure.domain, failure.cause)].append(i)
    rows = [_row(d, c, m, failures, lost) for (d, c), m in groups.items()]
    causes = list(Cause)
    return sorted(rows, key=lambda r: (-r.failures, _order(r.domain),
                                       causes.index(r.cause) if r.cause else 0))


def domain_rows(failures: Sequence[Failure], lost: TimeLost) -> list[AttributionRow]:
    """One row per domain that failed (``cause`` None), most failures first."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, failure in enumerate(failures):
        groups[failure.domain].append(i)
    rows = [_row(d, None, m, failures, lost) for d, m in groups.items()]
    return sorted(rows, key=lambda r: (-r.failures, _order(r.domain)))


def whole_percents(counts: Sequence[int]) -> list[int]:
    """Integer percentages of ``counts`` that sum to 100 (largest remainder first)."""
    total = sum(counts)
    if total <= 0:
        return [0] * len(counts)
    exact = [100 * c / total for c in counts]
    out = [int(x) for x in exact]
    by_remainder = sorted(range(len(counts)), key=lambda i: (out[i] - exact[i], i))
    for i in by_remainder[:100 - sum(out)]:
        out[i] += 1
    return out


def share_line(rows: Sequence[AttributionRow]) -> str:
    """``generation 67%, sandbox 33%``: the failure share of each domain row, in order."""
    percents = whole_percents([r.failures for r in rows])
    return ", ".join(f"{r.domain} {p}%" for r, p in zip(rows, percents, strict=True))

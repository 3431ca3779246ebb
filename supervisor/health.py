"""Failure detection decisions, pure: hangs by progress deadline, quarantine of unreachable
children.  The shell feeds observations in and acts on the verdicts.

Three cases (DESIGN.md):

- **Death** is not decided here: it arrives as an exit from the child's pending monitor call.
- **Hang**: a child that holds work in a phase with a deadline and whose progress counter has
  not moved for longer than that deadline is hung.  A child whose heartbeats (progress
  polls) go unanswered for longer than its liveness deadline, or its largest progress
  deadline, is hung too, whatever it last said: a stopped process cannot report that it
  holds work.
- **Unavailable**: the child could not be reached but is not known dead.  It is quarantined
  and probed every ``probe_interval_s`` until it answers (recovered), is confirmed dead, or
  stays unreachable past ``quarantine_timeout_s`` (then it is treated as lost).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace

from erlay.supervisor.progress import ProgressSnapshot


@dataclass(frozen=True)
class Health:
    """What the supervisor knows about one incarnation's liveness, on the supervisor's clock."""

    since: float                     # when this incarnation was started
    counter: int = -1
    phase: str | None = None
    work: str | None = None
    last_progress: float = 0.0       # when the counter last moved (or the incarnation began)
    last_answer: float = 0.0         # when a progress poll last answered
    unavailable_since: float | None = None

    @staticmethod
    def new(now: float) -> Health:
        return Health(since=now, last_progress=now, last_answer=now)


def observe(health: Health, snap: ProgressSnapshot | None, now: float) -> Health:
    """Record an answered poll.  A moved counter or a changed phase is progress."""
    if snap is None:  # the child has no progress counters: it answered, nothing more
        return replace(health, last_answer=now, unavailable_since=None)
    moved = snap.counter != health.counter or snap.phase != health.phase
    return replace(health, counter=snap.counter, phase=snap.phase, work=snap.work,
                   last_answer=now, unavailable_since=None,
                   last_progress=now if moved else health.last_progress)


def _last_seen(health: Health, now: float) -> str:
    """What the child last said: its phase and work, and how long ago it last progressed."""
    phase = f"phase {health.phase}" if health.phase else "no work"
    work = f" on {health.work}" if health.work else ""
    return f"last seen in {phase}{work}, last progress {now - health.last_progress:.1f} s ago"


def hang_verdict(health: Health, deadlines: Mapping[str, float], now: float,
                 liveness_s: float | None = None) -> str | None:
    """The reason the child counts as hung, or None.

    ``deadlines`` maps phase -> seconds; the key ``"*"`` applies to any phase not listed.
    ``liveness_s`` is the heartbeat deadline (:attr:`Liveness.deadline_s`): silence longer
    than it is a hang whatever the phase.  The reason names the phase and the last progress.
    """
    silent = now - health.last_answer
    if liveness_s is not None and silent > liveness_s:
        return (f"unresponsive: no heartbeat answered for {silent:.1f} s (liveness deadline "
                f"{liveness_s:g} s); {_last_seen(health, now)}")
    if not deadlines:
        return None
    if silent > max(deadlines.values()):
        return (f"unresponsive for {silent:.1f} s (largest deadline "
                f"{max(deadlines.values()):g} s); {_last_seen(health, now)}")
    if health.phase is None:
        return None
    deadline = deadlines.get(health.phase, deadlines.get("*"))
    if deadline is None:
        return None
    stalled = now - health.last_progress
    if stalled > deadline:
        work = f" on {health.work}" if health.work else ""
        return f"no progress in phase {health.phase}{work} for {stalled:.1f} s " \
               f"(deadline {deadline:g} s)"
    return None


def progress_age(health: Health, now: float) -> float:
    """Seconds since the child last made progress (``erlay status`` shows this)."""
    return now - health.last_progress


class Quarantine(enum.Enum):
    PROBE = "probe"        # keep probing
    RECOVERED = "recovered"
    LOST = "lost"          # confirmed dead, or unreachable for too long


def quarantine_verdict(unavailable_since: float, probe: bool | None, now: float,
                       quarantine_timeout_s: float) -> Quarantine:
    """Decide after one probe: ``probe`` is True (answered), False (confirmed dead) or None
    (still unreachable)."""
    match probe:
        case True:
            return Quarantine.RECOVERED
        case False:
            return Quarantine.LOST
        case None if now - unavailable_since > quarantine_timeout_s:
            return Quarantine.LOST
    return Quarantine.PROBE

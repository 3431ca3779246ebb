"""A run's time across its driver runs: the first one and each ``erlay run --resume``.

Every metrics record carries ``started_at``, the unix time its driver started (``time`` is
seconds since then); a resumed run appends to the same ``metrics.jsonl`` with its own.  So
the records fall into *segments*, one per driver run, and:

- a segment's *wall time* runs from its driver's start to its last record; the running
  driver's (the one writing the summary) runs to now, as it measured it;
- an *outage* is the gap between a segment's last record and the next driver's start:
  time the run lost to the driver being gone (killed, the machine down), which is neither
  wall time of a driver nor RL time;
- the *total wall time* is the segments' wall times plus the outages: from the first
  start to the end;
- the *RL time* is the sum of the RL step windows
  (:func:`erlay.actors.observe.attribution.step_windows`, which never spans an outage), and
  throughput is samples and tokens over it, not over one driver's wall clock.

Records from before ``started_at`` was recorded are one segment.  Pure: no I/O.

May import: erlay.actors.observe.attribution (pure: the step windows' one definition).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from erlay.actors.observe.attribution import step_windows


@dataclass(frozen=True)
class Segment:
    """One driver run's records: its start (unix, None when unrecorded), its wall time and
    the number of its records."""

    started_at: float | None
    wall_s: float
    records: int

    @property
    def ended_at(self) -> float | None:
        return None if self.started_at is None else self.started_at + self.wall_s


@dataclass(frozen=True)
class RunTiming:
    """The segments in order, the outage before each resumed one (``len(segments) - 1``
    values), and the RL time over all of them."""

    segments: tuple[Segment, ...]
    outages_s: tuple[float, ...]
    rl_s: float

    @property
    def wall_s(self) -> float:
        """Total wall time: every driver run and every outage between them."""
        return sum(s.wall_s for s in self.segments) + self.outage_s

    @property
    def outage_s(self) -> float:
        return sum(self.outages_s)

    @property
    def resumed(self) -> int:
        """How many times the run was resumed."""
        return max(0, len(self.segments) - 1)


def _started(record: Mapping[str, Any]) -> float | None:
    value = record.get("started_at")
    return float(value) if isinstance(value, int | float) else None


def split_segments(records: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """``records`` cut where ``started_at`` changes; a record without one stays in the
    segment it follows."""
    out: list[list[Mapping[str, Any]]] = []
    current: float | None = None
    for record in records:
        own = _started(record)
        if not out or (own is not None and current is not None and own != current):
            out.append([])
        if own is not None:
            current = own
        out[-1].append(record)
    return out


def run_timing(records: Sequence[Mapping[str, Any]], wall_s: float,
               started_at: float | None = None) -> RunTiming:
    """The timing of a run whose metrics are ``records``, as the driver that started at
    ``started_at`` and ran ``wall_s`` seconds ends it.  Without ``started_at`` the last
    segment is that driver's; a driver that wrote no record yet is a segment of its own."""
    segments: list[Segment] = []
    for seg in split_segments(records):
        times = [float(r["time"]) for r in seg if isinstance(r.get("time"), int | float)]
        segments.append(Segment(_started(seg[0]), max(times, default=0.0), len(seg)))
    current = Segment(started_at, wall_s, 0)
    last = segments[-1].started_at if segments else None
    # Records round started_at to the millisecond: within 10 ms is the same driver.
    if segments and (started_at is None or last is None or abs(last - started_at) < 0.01):
        current = Segment(segments[-1].started_at, wall_s, segments[-1].records)
        segments.pop()
    segments.append(current)
    outages = []
    for before, after in pairwise(segments):
        end, start = before.ended_at, after.started_at
        outages.append(max(0.0, start - end) if end is not None and start is not None else 0.0)
    rl = [r for r in records if r.get("phase") == "rl"]
    start = next((s for s in map(_started, records) if s is not None), None)
    rl_s = sum(w.wall_s for w in step_windows(rl, start))
    return RunTiming(tuple(segments), tuple(outages), rl_s)

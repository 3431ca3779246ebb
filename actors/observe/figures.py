"""What the report's throughput figure draws, decided apart from drawing it.

Pure: no matplotlib, no I/O.  :mod:`erlay.actors.observe.report` draws what
:func:`throughput_plan` says: the raw per-step rate faintly, its rolling mean on top (the raw
series zigzags with the steps' lengths), and a dashed line per failure, with "dashed:
failures" in the title and a legend entry, only when there were failures.

May import: nothing outside the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SMOOTH_STEPS = 5
"""Steps in the throughput figure's rolling mean."""


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """The trailing mean of up to ``window`` values ending at each one (fewer at the
    start), so the result has one value per input and no lag beyond the window."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out: list[float] = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


@dataclass(frozen=True)
class ThroughputPlan:
    """One throughput panel: ``raw`` (faint) and ``smooth`` are (x, rate) points, the same
    x; ``failures`` the x of each dashed failure line; ``legend`` the labels, in the order
    the series are drawn (raw, smooth, then the failures' one label when there are any)."""

    raw: list[tuple[float, float]]
    smooth: list[tuple[float, float]]
    failures: list[float]
    legend: list[str]


def throughput_plan(points: Sequence[tuple[float, float]], failure_times: Sequence[float],
                    window: int = SMOOTH_STEPS) -> ThroughputPlan:
    """The panel for per-step rate ``points`` (x, rate), in step order, and the failures at
    ``failure_times`` (same x axis).  No points: nothing is drawn, failures neither."""
    if not points:
        return ThroughputPlan([], [], [], [])
    xs = [x for x, _ in points]
    smooth = list(zip(xs, rolling_mean([r for _, r in points], window), strict=True))
    failures = sorted(failure_times)
    legend = ["per step", f"mean of {window} steps"] + (["failure"] if failures else [])
    return ThroughputPlan(list(points), smooth, failures, legend)


def throughput_title(failures: int, window: int = SMOOTH_STEPS) -> str:
    """The figure's title: mentions failures only when there were any."""
    title = f"Throughput per RL step (line: mean of {window} steps"
    return title + ("; dashed: failures)" if failures else ")")

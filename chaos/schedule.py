"""When a scenario's faults fire: a pure function of the faults and the duration.

Offsets are seconds after the job's first RL step.  ``at`` fires once; ``every`` at
``start + k * every`` (``start`` defaults to ``every``); ``random`` at the arrivals of a
Poisson process, ``random.Random(seed).expovariate(rate_per_s)`` from ``start`` (default 0).
``every`` and ``random`` stop at ``count.max``; nothing fires at or after the duration.  The
same faults always give the same schedule.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol

from erlay.chaos.scenario_errors import ScenarioError


class _Random(Protocol):
    @property
    def rate_per_s(self) -> float: ...
    @property
    def seed(self) -> int: ...


class _Count(Protocol):
    @property
    def min(self) -> int: ...
    @property
    def max(self) -> int | None: ...


class TimedFault(Protocol):
    """The timing fields of a fault, all this module reads.  A scenario's ``FaultSpec``
    (:mod:`erlay.chaos.scenario`, which imports this module, not the other way round) has
    them."""

    @property
    def at(self) -> float | None: ...
    @property
    def at_step(self) -> int | None: ...
    @property
    def every(self) -> float | None: ...
    @property
    def start(self) -> float | None: ...
    @property
    def random(self) -> _Random | None: ...
    @property
    def count(self) -> _Count | None: ...


def firings(fault: TimedFault, duration_s: float) -> list[float]:
    """The offsets at which ``fault`` fires within ``duration_s``, in order."""
    if fault.at is not None:
        return [fault.at] if fault.at < duration_s else []
    if fault.at_step is not None:
        return []  # fired by training progress, not by the clock (Scenario.step_schedule)
    limit = fault.count.max if fault.count is not None and fault.count.max is not None else 0
    times: list[float] = []
    if fault.every is not None:
        first = fault.every if fault.start is None else fault.start
        # k * every, not a running sum: no float drift over a long soak
        while len(times) < limit and (t := first + len(times) * fault.every) < duration_s:
            times.append(t)
    elif fault.random is not None:
        rng = random.Random(fault.random.seed)
        t = fault.start or 0.0
        while len(times) < limit:
            t += rng.expovariate(fault.random.rate_per_s)
            if t >= duration_s:
                break
            times.append(t)
    return times


def schedule_problems(faults: Sequence[TimedFault], duration_s: float
                      ) -> list[tuple[int, tuple[str, ...], str, Any]]:
    """(fault index, key under the fault, text, given) for every fault whose ``count.min``
    cannot fit in ``duration_s``, and every ``at``/``every`` fault that never fires there."""
    problems: list[tuple[int, tuple[str, ...], str, Any]] = []
    for i, fault in enumerate(faults):
        if fault.at_step is not None:
            continue
        fired = len(firings(fault, duration_s))
        if fault.count is not None and fired < fault.count.min:
            problems.append((i, ("count", "min"), f"count.min {fault.count.min} cannot fit in "
                             f"duration {duration_s:g} s: {timing_text(fault)} fires "
                             f"{fired} time(s) before it ends", fault.count.min))
        elif fired == 0 and fault.random is None:
            key = "at" if fault.at is not None else "start"
            problems.append((i, (key,), f"expected a first firing before duration_s "
                             f"({duration_s:g}); it never fires",
                             fault.at if fault.at is not None else fault.start))
    return problems


def timing_text(fault: TimedFault) -> str:
    """The fault's timing in words, e.g. ``every 20 s from 20 s``."""
    if fault.at is not None:
        return f"at {fault.at:g} s"
    if fault.at_step is not None:
        return f"after RL step {fault.at_step}"
    if fault.every is not None:
        first = fault.every if fault.start is None else fault.start
        return f"every {fault.every:g} s from {first:g} s"
    assert fault.random is not None
    return f"random (rate {fault.random.rate_per_s:g}/s, seed {fault.random.seed})"


def schedule(faults: Sequence[TimedFault], duration_s: float) -> list[tuple[float, int]]:
    """Every firing as ``(offset seconds after RL starts, fault index)``, sorted by time, then
    index; nothing at or after ``duration_s``.

    Raises :class:`ScenarioError` naming the fault (``faults.3.count.min: count.min 5 cannot
    fit in duration 60 s: ...``) when a ``count.min`` cannot be met.  A fault that never
    fires is not an error here (a loaded :class:`~erlay.chaos.scenario.Scenario` rejects it).
    """
    short = [p for p in schedule_problems(faults, duration_s) if p[1] == ("count", "min")]
    if short:
        lines = [f"faults.{i}.count.min: {text}" for i, _, text, _ in short]
        raise ScenarioError("; ".join(lines), lines)
    return sorted((t, i) for i, fault in enumerate(faults) for t in firings(fault, duration_s))

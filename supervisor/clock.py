"""Injected clocks, so time-dependent decisions are tested deterministically.

The decision core takes ``now`` as an argument; the shell reads it from a :class:`Clock`.
Production uses :class:`SystemClock`; tests use :class:`FakeClock` and move time by hand.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards; used for every decision."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch; used only to stamp events for humans."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0, wall_offset: float = 1.7e9) -> None:
        self.now = start
        self.wall_offset = wall_offset

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + self.wall_offset

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now

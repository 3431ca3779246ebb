"""Progress counters a child updates as it works; the supervisor's hang detection reads them.

A child that holds work says which phase it is in (``begin("decode_step", work="r-17")``) and
ticks as it makes progress.  The supervisor polls :meth:`Progress.snapshot` and declares the
child hung when it holds work and its counter has not moved for longer than the phase's
deadline.  A health check that answers while the work loop is wedged proves nothing; only
ticks from the work itself count.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProgressSnapshot:
    counter: int          # grows with every tick, begin and end; never goes back
    phase: str | None     # phase of the work held, or None when idle
    work: str | None      # what is being worked on, for humans (``erlay status``)

    def to_dict(self) -> dict[str, Any]:
        return {"counter": self.counter, "phase": self.phase, "work": self.work}

    @staticmethod
    def from_dict(data: dict[str, Any] | None) -> ProgressSnapshot | None:
        if data is None:
            return None
        return ProgressSnapshot(int(data["counter"]), data.get("phase"), data.get("work"))


class Progress:
    """Thread-safe; cheap enough to tick once per decode step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counter = 0
        self._phase: str | None = None
        self._work: str | None = None

    def begin(self, phase: str, work: str | None = None) -> None:
        """Start holding work in ``phase``; the phase's deadline applies from now."""
        with self._lock:
            self._phase, self._work = phase, work
            self._counter += 1

    def tick(self, n: int = 1) -> None:
        with self._lock:
            self._counter += n

    def end(self) -> None:
        """Stop holding work; no deadline applies while idle."""
        with self._lock:
            self._phase = self._work = None
            self._counter += 1

    @contextmanager
    def working(self, phase: str, work: str | None = None) -> Iterator[Progress]:
        self.begin(phase, work)
        try:
            yield self
        finally:
            self.end()

    def snapshot(self) -> ProgressSnapshot:
        with self._lock:
            return ProgressSnapshot(self._counter, self._phase, self._work)

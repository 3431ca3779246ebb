"""An engine's boot timeline: when each stage of its start-up and its first service ended.

A restarted engine is back in service only once it has gone through every stage below, and
the restart benchmark (``bench/engine_restart.py``) splits a restart's time by them.  The
marks are wall-clock seconds (``time.time()``), so they compare across processes on one
machine (a node's clock), and each is set once, at its first occurrence:

- ``process_started``: the engine's process began (the OS's record of it, via psutil);
- ``imports_started`` / ``imports_done``: the engine module's own imports (torch, the model
  code); what the process imported before them is part of the actor's start;
- ``init_started``, ``model_built``, ``warmed``: the constructor's entry, the model built
  (random or initial weights), one throwaway decode that touches every kernel the engine
  uses (:func:`warm_up`);
- ``first_weights``: the first weight version it serves loaded (its admission by the pool);
- ``first_request``: the first request it was handed; ``first_admitted``: that request in a
  decode batch (the rollout is being served).

An engine that was a warm spare (:mod:`erlay.supervisor.spares`) has its start-up marks from
long before the failure it replaced; only the marks after the failure are on the restart's
critical path.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

STAGES = ("process_started", "imports_started", "imports_done", "init_started", "model_built",
          "warmed", "first_weights", "first_request", "first_admitted")


def process_started() -> float | None:
    """When this process began (wall clock), or None where psutil cannot say."""
    try:
        import psutil
        return float(psutil.Process(os.getpid()).create_time())
    except Exception:  # noqa: BLE001 - a timeline without this mark is still a timeline
        return None


@dataclass
class BootTimeline:
    """The marks of one engine process (see the module docstring); each set once."""

    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, stage: str, at: float | None = None) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown boot stage {stage!r}; known: {', '.join(STAGES)}")
        if stage not in self.marks:
            self.marks[stage] = time.time() if at is None else at

    def to_dict(self) -> dict[str, float]:
        return {s: self.marks[s] for s in STAGES if s in self.marks}

"""``erlay verify RUN_DIR``: did this run train every rollout exactly once, lose none, and
keep its checkpoints intact?  Asked of any run directory (a chaos run or a week-long
production run; finished, failed, or killed mid-write, or still running), answered from its
durable files alone (:func:`erlay.chaos.evidence.observe_dir`) with the chaos suite's own
invariants, so ``erlay chaos run`` and ``erlay verify`` can never disagree about a record.

The invariants that apply to any run are :data:`VERIFIED`; those that need a scenario (the
faults it injected, a fault-free baseline, the processes it watched) are the chaos
runner's alone.  Exit codes: 0 when every applicable invariant PASSes (an N/A, with its
documented reason, does not apply), 1 when one FAILs or cannot be checked, 2 when the
path is not a run directory.  Never starts Ray.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from erlay.chaos.evidence import observe_dir
from erlay.chaos.invariants import check_all
from erlay.chaos.observation import RunObservation, Verdict
from erlay.chaos.report import verdict_counts

VERIFIED = ("no_rollout_lost", "no_duplicate_consumption", "exactly_once",
            "staleness_within_bound", "steps_in_order", "tool_calls_once",
            "judgements_stable", "checkpoints_intact", "restart_intensity_respected")


@dataclass(frozen=True)
class Verification:
    """The verdicts on one run directory and what was past its last write."""

    path: Path
    observation: RunObservation
    verdicts: list[Verdict]

    @property
    def ok(self) -> bool:
        return all(v.ok is not False for v in self.verdicts)

    def to_dict(self) -> dict[str, Any]:
        counts = verdict_counts(self.verdicts)
        return {"run_dir": str(self.path), "ok": self.ok, "status": self.observation.status,
                "steps_trained": self.observation.steps_trained, **counts,
                "failed": [v.name for v in self.verdicts if v.ok is False],
                "notes": list(self.observation.notes),
                "invariants": [v.to_dict() for v in self.verdicts]}


def verify(path: Path | str) -> Verification:
    """Every invariant of :data:`VERIFIED` on the run directory ``path``.  Raises
    :class:`erlay.chaos.evidence.NotARunDir`."""
    obs = observe_dir(path)
    return Verification(Path(path), obs, check_all(obs, selected=list(VERIFIED)))


def render(result: Verification, out: Callable[[str], None] = print) -> None:
    """The table, then the notes, then one JSON line (without the per-invariant details)."""
    obs = result.observation
    out(f"run {result.path} ({obs.status}, {obs.steps_trained} RL steps)")
    out(f"{'invariant':30s} {'verdict':7s} detail")
    for v in result.verdicts:
        out(f"{v.name:30s} {v.status:7s} {v.detail}")
    for note in obs.notes:
        out(f"note: {note}")
    line = result.to_dict()
    del line["invariants"]
    out(json.dumps(line))

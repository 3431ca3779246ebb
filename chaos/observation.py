"""What the chaos invariants judge: one finished run's :class:`RunObservation`, and the
:class:`Verdict` each invariant returns.

A verdict is PASS, FAIL or N/A, and N/A means one thing only: the invariant does not apply
to this run (no fault-free baseline was requested; token identity while ``max_staleness``
is above 0).  An invariant that applies but whose evidence is missing (no ledger, no
journal stream, no checkpoint listing) FAILS, saying it could not check: a check that did
not run proves nothing, so it must not pass.  Pure data: no I/O here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from erlay.chaos.faults import FaultRecord
from erlay.supervisor.events import SupervisorEvent

STATUSES = ("finished", "failed", "stalled")
# The reasons an invariant may be N/A (docs/chaos.md lists them); any other missing
# evidence is a FAIL ("cannot check").
NO_STEP_TRAINED = "no step was trained, so nothing was consumed or fed"
_ROLLOUT_ID = re.compile(r"^r(\d+)-")  # f"r{step:05d}-g{group:03d}-{k}"


@dataclass(frozen=True)
class Verdict:
    """One invariant's judgement.  ``ok`` is True (held), False (violated, or could not be
    checked although it applies) or None (does not apply to this run; ``detail`` says why)."""

    name: str
    ok: bool | None
    detail: str

    @property
    def status(self) -> str:
        """``PASS``, ``FAIL`` or ``N/A``."""
        return {True: "PASS", False: "FAIL", None: "N/A"}[self.ok]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "status": self.status, "detail": self.detail}


def cannot_check(name: str, why: str) -> Verdict:
    """The verdict of an invariant that applies but whose evidence is missing: a FAIL."""
    return Verdict(name, False, f"cannot check: {why}")


@dataclass
class RunObservation:
    """Everything the invariants look at, gathered from one run after it ended.

    From the journal's transition stream (``stream_observed``: False when the driver ran in
    a process the runner could not tee, e.g. a resumed subprocess; then only the journal's
    compacted state is known, and the stream-only invariants cannot check):

    - ``consumed_transitions``: ``(rollout_id, step)`` of every CONSUMED transition, in
      order, repeats included (a rewind consumes the same rollouts again).
    - ``dispatched_ids``: the id of every rollout ever dispatched.
    - ``tool_events``: ``(kind, key, result)`` of every TOOL_CALL (``"call"``, result None)
      and TOOL_RESULT (``"result"``) in stream order: a call of a key whose result was
      already journaled, or two different results of one key, is a tool call executed
      again.  (Two equal results are not: the sandbox answers a repeated key from its
      idempotency cache.)
    - ``judgements``: ``(key, judgement)`` of every JUDGED transition, repeats included.

    From the run dir:

    - ``events``: every supervisor event (``events.jsonl``), in any order.
    - ``metrics``: every ``metrics.jsonl`` record (all phases).  A step may appear twice in
      phase ``rl``: again after a learner rewind, or as a ``recovered`` record.
    - ``ledger``: the learner's ledger records (:mod:`erlay.actors.learner.ledger`), or None
      when the run has none.
    - ``checkpoints``: ``(step, problem)`` for every committed checkpoint, ``problem`` None
      when it verifies (manifest and content hashes), or None when not listed.

    From the runner: ``faults`` (injected, in order), ``not_injected``, ``wall_s``,
    ``rl_wall_s`` (first to last RL step, the goodput denominator), ``status``
    (``finished``, ``failed`` or ``stalled``), ``offender``, ``orphans`` (processes left
    behind, each ``{"pid", "cmdline"}``), ``started_at`` (unix time the job started; a
    metric's ``time`` counts from it), ``steps_trained``, ``max_staleness``, and
    ``intensity`` (supervisor path -> (intensity, period s)).
    """

    events: list[SupervisorEvent] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    consumed_transitions: list[tuple[str, int]] = field(default_factory=list)
    dispatched_ids: set[str] = field(default_factory=set)
    tool_events: list[tuple[str, str, Any]] = field(default_factory=list)
    judgements: list[tuple[str, Any]] = field(default_factory=list)
    stream_observed: bool = True
    ledger: list[dict[str, Any]] | None = None
    checkpoints: list[tuple[int, str | None]] | None = None
    steps_trained: int = 0
    faults: list[FaultRecord] = field(default_factory=list)
    wall_s: float = 0.0
    rl_wall_s: float | None = None
    max_staleness: int = 1
    intensity: dict[str, tuple[int, float]] = field(default_factory=dict)
    orphans: list[dict[str, Any]] = field(default_factory=list)
    status: str = "finished"
    offender: str | None = None
    started_at: float | None = None
    not_injected: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status: expected one of {', '.join(STATUSES)}, "
                             f"got {self.status!r}")

    def rl_records(self) -> list[dict[str, Any]]:
        """Every ``rl`` metric record, in file order, repeats included."""
        return [m for m in self.metrics if m.get("phase") == "rl"]

    def rl_steps(self) -> list[dict[str, Any]]:
        """One ``rl`` record per step (the last one written), sorted by step."""
        return distinct_steps(self.metrics)

    def sorted_events(self) -> list[SupervisorEvent]:
        return sorted(self.events, key=lambda e: e.time)


def distinct_steps(metrics: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ``rl`` record per step, the last written (the one that stuck), sorted by step."""
    last: dict[int, dict[str, Any]] = {}
    for m in metrics:
        if m.get("phase") == "rl":
            last[int(m["step"])] = m
    return [last[s] for s in sorted(last)]


def few(items: Iterable[object], n: int = 5) -> str:
    """The first ``n`` items, comma-separated, with the total when there are more."""
    items = list(items)
    text = ", ".join(str(i) for i in items[:n])
    return text + (f", ... ({len(items)} in all)" if len(items) > n else "")


def rollout_step(rollout_id: str) -> int | None:
    """The learner step a rollout id was made for (``r00042-g003-1`` -> 42), or None."""
    m = _ROLLOUT_ID.match(rollout_id)
    return int(m.group(1)) if m else None

"""What the chaos invariants judge: one finished run's :class:`RunObservation`, and the
:class:`Verdict` each invariant returns.

A verdict is PASS, FAIL or N/A, and N/A means one thing only: the invariant does not apply
to this run, for one of the reasons in :data:`NA_REASONS` (``docs/chaos.md`` lists them);
:func:`erlay.chaos.invariants.check_all` turns an N/A for any other reason into a FAIL.  An
invariant that applies but whose evidence is missing (no ledger, no journal, no checkpoint)
FAILS, saying it could not check: a check that did not run proves nothing, so it must not
pass.  Pure data: no I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from erlay.actors.journal.rollout_id import step_of
from erlay.chaos.faults import FaultRecord
from erlay.supervisor.events import SupervisorEvent

# ``unended``: no end was recorded (``erlay verify`` of a run still running, or killed).
STATUSES = ("finished", "failed", "stalled", "unended")
# The reasons an invariant may be N/A (docs/chaos.md lists them, in this order); a verdict's
# detail starts with one.  Any other missing evidence is a FAIL ("cannot check").
NO_STEP_TRAINED = "no step was trained, so nothing was consumed or fed"
NO_BASELINE = "no fault-free baseline was requested"
STALENESS_ABOVE_0 = "max_staleness above 0"
NO_FAULT = "no fault was injected"
DRIVER_FAULTS_ONLY = "only driver faults, which no supervisor watches"
NO_TOOL_CALL = "the run made no tool call"
NO_JUDGEMENT = "no sample was judged: the environment rewarded every sample itself"
NA_REASONS = (NO_STEP_TRAINED, NO_BASELINE, STALENESS_ABOVE_0, NO_FAULT, DRIVER_FAULTS_ONLY,
              NO_TOOL_CALL, NO_JUDGEMENT)


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

    From the journal on disk (:mod:`erlay.chaos.evidence`: its newest usable snapshot and
    the segments after it; ``journal_found`` False when it cannot be read, and then
    ``journal_problem`` says why: none, corrupt, or written before what verifying needs):

    - ``consumed_transitions``: ``(rollout_id, step)`` of every CONSUMED transition ever
      recorded, repeats included (a rewind consumes the same rollouts again): the
      journal's side of exactly-once, a multiset.
    - ``dispatched_ids``: the id of every rollout ever dispatched.
    - ``filtered_ids``: the rollouts consumed with weight 0 because dynamic sampling
      dropped their group (their CONSUMED transition says ``filtered``).
    - ``journal_kinds``: how many transitions of each kind were ever recorded, and
      ``journal_anomalies`` the journal fold's anomaly counts by reason (a tool call made
      after its result was journaled, two different results or judgements for one key).
    - ``tool_events``: ``(kind, key, result)`` of every TOOL_CALL (``"call"``, result None)
      and TOOL_RESULT (``"result"``) in the segments still on disk, in order, and
      ``judgements``: ``(key, judgement)`` of their JUDGED transitions: they name the keys
      of what the anomaly counts found.
    - ``notes``: what was past the last write (a torn tail of a file being written), which
      is reported, never judged.

    From the run dir:

    - ``events``: every supervisor event (``events.jsonl``), in any order.
    - ``metrics``: every ``metrics.jsonl`` record (all phases).  A step may appear twice in
      phase ``rl``: again after a learner rewind, or as a ``recovered`` record.
    - ``ledger``: the learner's ledger records (:mod:`erlay.actors.learner.ledger`), or None
      when the run has none or it is unreadable (``ledger_problem`` says which).
    - ``checkpoints``: ``(step, problem)`` for every committed checkpoint, ``problem`` None
      when it verifies (manifest and content hashes), or None when not listed.
    - ``judge_failed``: samples the metrics say the judge failed (so it ran).

    From the runner: ``faults`` (injected, in order), ``not_injected``, ``wall_s``,
    ``rl_wall_s`` (first to last RL step, the goodput denominator), ``status``
    (one of :data:`STATUSES`), ``offender``, ``orphans`` (processes left
    behind, each ``{"pid", "cmdline"}``), ``started_at`` (unix time the job started; a
    metric's ``time`` counts from it), ``steps_trained``, ``max_staleness``, and
    ``intensity`` (supervisor path -> (intensity, period s)).
    """

    events: list[SupervisorEvent] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    consumed_transitions: list[tuple[str, int]] = field(default_factory=list)
    dispatched_ids: set[str] = field(default_factory=set)
    filtered_ids: set[str] = field(default_factory=set)
    tool_events: list[tuple[str, str, Any]] = field(default_factory=list)
    judgements: list[tuple[str, Any]] = field(default_factory=list)
    journal_found: bool = True
    journal_problem: str | None = None
    journal_kinds: dict[str, int] = field(default_factory=dict)
    journal_anomalies: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    judge_failed: int = 0
    ledger: list[dict[str, Any]] | None = None
    ledger_problem: str | None = None
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

    def kept_step(self) -> int:
        """The step the newest intact checkpoint resumes at: every step below it is kept
        in a checkpoint (0 when none is: nothing is kept)."""
        return max((step for step, problem in self.checkpoints or () if problem is None),
                   default=0)


def not_applicable(name: str, reason: str, more: str = "") -> Verdict:
    """The N/A verdict for ``reason`` (one of :data:`NA_REASONS`), with ``more`` after it."""
    if reason not in NA_REASONS:
        raise ValueError(f"{reason!r} is not a documented N/A reason")
    return Verdict(name, None, reason + (f": {more}" if more else ""))


def documented_na(verdict: Verdict) -> Verdict:
    """``verdict``, or a FAIL when it is N/A for a reason docs/chaos.md does not list."""
    if verdict.ok is not None or any(verdict.detail.startswith(r) for r in NA_REASONS):
        return verdict
    return cannot_check(verdict.name, f"N/A for an undocumented reason ({verdict.detail})")


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


# The learner step a rollout id was made for (``r00042-g003-1`` -> 42), or None.
rollout_step = step_of

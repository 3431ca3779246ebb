"""The rollout journal's folded state: a pure fold of transitions, with no I/O.

:func:`apply` folds one :class:`~erlay.actors.journal.transitions.Transition` into a
:class:`JournalState`. The journal calls it on every record and again, in the same order, on
recovery, so the live state and the recovered state are equal by construction.  The fold never
raises on odd input: a transition for an unknown rollout, a second completion, a tool result nobody
asked for are each counted in ``JournalState.anomalies`` (by reason) and folded as far as they make
sense, because a journal that cannot be recovered is worse than one with a counted oddity.

What a rollout keeps depends on its state (:class:`RolloutState`):

- in flight (dispatched, not completed) and completed-but-not-consumed rollouts keep their
  full record: dispatch, every chunk, observation, tool call and result, judgement;
- consumed rollouts keep their full record only until :func:`compact` (run at every
  snapshot) drops it.  Their id and learner step stay in ``JournalState.consumed`` for good,
  because exactly-once training relies on knowing every rollout a step already trained on.

What the state keeps for good, so that ``erlay verify`` can judge a whole run from one
snapshot and the segments after it: ``consumed`` (each id's first step), ``consumed_again``
(the step of every later consumption of an id: a re-feed after a learner restore names the
same step, a double use another one), ``kinds`` (how many transitions of each kind were
ever folded) and ``anomalies`` (by reason; a tool call after its result was journaled, a
different result or judgement for a key each have a reason of their own).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, assert_never

from erlay.actors.journal.transitions import Transition, TransitionKind

# One history entry: (transition kind, reference into the record).  The reference is the
# index into ``chunks``/``observations``, the key into ``tool_calls``/``tool_results``/
# ``judgements``, or None for dispatched/completed/consumed.
HistoryEntry = tuple[str, int | str | None]

# Anomaly reasons the chaos invariants read (with the kind's value before them).
AGAIN_AFTER_RESULT = "called again after its result was journaled"
SAME_AGAIN = "key already has the same one"
DIFFERENT = "key already has a different one"


class RolloutState(enum.Enum):
    IN_FLIGHT = "in_flight"    # dispatched, not completed
    COMPLETED = "completed"    # completed, not consumed by a learner step
    CONSUMED = "consumed"      # trained on by a learner step


@dataclass
class RolloutRecord:
    """Everything journaled about one rollout, in the shapes the coordinator recorded.

    ``chunks`` hold ``{turn, start, token_ids, logprobs, version}``; ``observations`` hold
    ``{turn, token_ids}``; ``tool_calls`` map idempotency key to code and ``tool_results`` key
    to result; ``judgements`` map judge key to judgement.  ``history`` lists every folded
    transition of this rollout in arrival order, as references into those fields.
    """

    rollout_id: str
    dispatched: dict[str, Any]
    chunks: list[dict[str, Any]] = field(default_factory=list)
    observations: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: dict[str, str] = field(default_factory=dict)
    tool_results: dict[str, Any] = field(default_factory=dict)
    judgements: dict[str, Any] = field(default_factory=dict)
    completed: dict[str, Any] | None = None
    consumed_step: int | None = None
    history: list[HistoryEntry] = field(default_factory=list)

    @property
    def state(self) -> RolloutState:
        if self.consumed_step is not None:
            return RolloutState.CONSUMED
        if self.completed is not None:
            return RolloutState.COMPLETED
        return RolloutState.IN_FLIGHT

    def pending_tool_calls(self) -> dict[str, str]:
        """Tool calls (key -> code) with no recorded result: the ones a resume must run."""
        return {k: code for k, code in self.tool_calls.items() if k not in self.tool_results}

    def turn_output(self, turn: int) -> tuple[list[int], list[float], list[int]]:
        """Tokens, logprobs and versions generated in ``turn``, as one contiguous prefix.

        Chunks are laid at their ``start``; a chunk that overlaps what is already laid (an
        engine re-sent a prefix) contributes only its new tail, and the prefix stops at the
        first gap, so a resume never continues after a hole.
        """
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for chunk in self.chunks:
            if chunk.get("turn") != turn:
                continue
            start = int(chunk.get("start", 0))
            ids, lps = list(chunk.get("token_ids", [])), list(chunk.get("logprobs", []))
            if start > len(tokens):
                break
            skip = len(tokens) - start
            tokens += ids[skip:]
            logprobs += lps[skip:]
            versions += [int(chunk.get("version", -1))] * max(0, len(ids) - skip)
        return tokens, logprobs, versions


@dataclass
class JournalState:
    """The journal folded: live rollouts, every consumed id, anomaly counts.

    ``applied`` counts every transition folded (anomalies included); it is the journal's
    sequence number, so a snapshot says exactly how much of the log it covers.
    """

    rollouts: dict[str, RolloutRecord] = field(default_factory=dict)
    consumed: dict[str, int] = field(default_factory=dict)
    consumed_again: dict[str, list[int]] = field(default_factory=dict)
    filtered: set[str] = field(default_factory=set)   # consumed with weight 0 (DAPO)
    kinds: dict[str, int] = field(default_factory=dict)
    anomalies: dict[str, int] = field(default_factory=dict)
    applied: int = 0
    # False when recovered from a snapshot written before ``kinds`` and ``consumed_again``
    # were kept: their counts then cover only the records after it.
    complete: bool = True

    # ------------------------------------------------------------------ queries
    def rollout(self, rollout_id: str) -> RolloutRecord | None:
        """The full record, or None if unknown or compacted away after consumption."""
        return self.rollouts.get(rollout_id)

    def rollout_state(self, rollout_id: str) -> RolloutState | None:
        """The rollout's state; consumed rollouts stay known after compaction."""
        record = self.rollouts.get(rollout_id)
        if record is not None:
            return record.state
        return RolloutState.CONSUMED if rollout_id in self.consumed else None

    def in_flight(self) -> list[RolloutRecord]:
        """Dispatched, not completed, in dispatch order: what a resume must continue."""
        return [r for r in self.rollouts.values() if r.state is RolloutState.IN_FLIGHT]

    def completed_unconsumed(self) -> list[RolloutRecord]:
        """Completed rollouts no learner step has trained on yet, in dispatch order."""
        return [r for r in self.rollouts.values() if r.state is RolloutState.COMPLETED]

    def tool_result(self, key: str) -> Any | None:
        """The recorded result of the tool call with idempotency ``key``, or None.

        Looked up across live records; results of consumed rollouts are compacted away, and
        nothing should ask for them (a consumed rollout is never resumed)."""
        for record in self.rollouts.values():
            if key in record.tool_results:
                return record.tool_results[key]
        return None

    def judgement(self, key: str) -> Any | None:
        """The recorded judgement under judge ``key``, or None."""
        for record in self.rollouts.values():
            if key in record.judgements:
                return record.judgements[key]
        return None

    def by_state(self) -> dict[str, int]:
        """Rollout counts by state name; consumed counts every consumed id ever recorded."""
        counts = {s.value: 0 for s in RolloutState}
        for record in self.rollouts.values():
            if record.state is not RolloutState.CONSUMED:
                counts[record.state.value] += 1
        counts[RolloutState.CONSUMED.value] = len(self.consumed)
        return counts

    @property
    def anomaly_count(self) -> int:
        return sum(self.anomalies.values())

    def ids_in(self, state: RolloutState) -> list[str]:
        """Rollout ids in ``state``; for CONSUMED, every consumed id (compacted ones too)."""
        if state is RolloutState.CONSUMED:
            return list(self.consumed)
        return [rid for rid, r in self.rollouts.items() if r.state is state]


# ---------------------------------------------------------------------- the fold
def _anomaly(state: JournalState, kind: TransitionKind, reason: str) -> None:
    name = f"{kind.value}: {reason}"
    state.anomalies[name] = state.anomalies.get(name, 0) + 1


def apply(state: JournalState, t: Transition) -> JournalState:
    """Fold ``t`` into ``state`` (in place) and return it.  Never raises on odd input.

    Rules, so a replayed log always folds the same way: the first dispatch, completion,
    tool result and judgement for a key win and later ones are anomalies; a repeated tool
    call with the same key is idempotent; a consumption is always recorded in ``consumed``
    (first step wins), even for an unknown rollout, because forgetting it could train on a
    rollout twice.
    """
    state.applied += 1
    state.kinds[t.kind.value] = state.kinds.get(t.kind.value, 0) + 1
    record = state.rollouts.get(t.rollout_id)
    data = t.data
    if t.kind is TransitionKind.DISPATCHED:
        if record is not None or t.rollout_id in state.consumed:
            _anomaly(state, t.kind, "rollout already dispatched")
            return state
        state.rollouts[t.rollout_id] = RolloutRecord(t.rollout_id, dict(data),
                                                     history=[(t.kind.value, None)])
        return state
    if t.kind is TransitionKind.CONSUMED:
        _consume(state, record, t)
        return state
    if record is None:
        _anomaly(state, t.kind, "unknown rollout")
        return state
    if record.completed is not None and t.kind is not TransitionKind.COMPLETED:
        _anomaly(state, t.kind, "after completion")  # folded anyway: data is never dropped
    ref: int | str | None = None
    match t.kind:
        case TransitionKind.CHUNK:
            ref = len(record.chunks)
            record.chunks.append(dict(data))
        case TransitionKind.OBSERVATION:
            ref = len(record.observations)
            record.observations.append(dict(data))
        case TransitionKind.TOOL_CALL:
            key = data.get("key")
            if not isinstance(key, str):
                _anomaly(state, t.kind, "no key")
                return state
            if key in record.tool_results:
                # A replay must reuse a journaled result: a call announced after it is a
                # tool call executed again (chaos invariant tool_calls_once).
                _anomaly(state, t.kind, AGAIN_AFTER_RESULT)
                return state
            if key in record.tool_calls:
                return state  # idempotent: a resumed rollout may announce its call again
            record.tool_calls[key] = str(data.get("code", ""))
            ref = key
        case TransitionKind.TOOL_RESULT | TransitionKind.JUDGED:
            key = data.get("key")
            table = (record.tool_results if t.kind is TransitionKind.TOOL_RESULT
                     else record.judgements)
            if not isinstance(key, str):
                _anomaly(state, t.kind, "no key")
                return state
            if key in table:
                value = data.get("result" if t.kind is TransitionKind.TOOL_RESULT
                                 else "judgement")
                # Equal: the sandbox's idempotency cache answering a repeated call.
                _anomaly(state, t.kind, SAME_AGAIN if table[key] == value else DIFFERENT)
                return state
            if t.kind is TransitionKind.TOOL_RESULT and key not in record.tool_calls:
                _anomaly(state, t.kind, "no matching tool call")
            table[key] = data.get("result" if t.kind is TransitionKind.TOOL_RESULT
                                  else "judgement")
            ref = key
        case TransitionKind.COMPLETED:
            if record.completed is not None:
                _anomaly(state, t.kind, "already completed")
                return state
            record.completed = dict(data)
        case TransitionKind.DISPATCHED | TransitionKind.CONSUMED:
            raise AssertionError("handled above")
        case _:
            assert_never(t.kind)
    record.history.append((t.kind.value, ref))
    return state


def _consume(state: JournalState, record: RolloutRecord | None, t: Transition) -> None:
    step = t.data.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        _anomaly(state, t.kind, "no integer step")
        return
    known = state.consumed.get(t.rollout_id)
    if known is not None:
        # First step wins; a repeat of the same step (a re-feed after a learner restore) is
        # idempotent for the fold, and every repeat is kept for the invariants.
        state.consumed_again.setdefault(t.rollout_id, []).append(step)
        if known != step:
            _anomaly(state, t.kind, "already consumed by another step")
        return
    state.consumed[t.rollout_id] = step
    if t.data.get("filtered") is True:   # dynamic sampling dropped its group
        state.filtered.add(t.rollout_id)
    if record is None:
        _anomaly(state, t.kind, "unknown rollout")
        return
    if record.completed is None:
        _anomaly(state, t.kind, "before completion")
    record.consumed_step = step
    record.history.append((t.kind.value, None))


def compact(state: JournalState, keep_from_step: int | None = None) -> int:
    """Drop the full records of consumed rollouts (their ids and steps stay in
    ``consumed``); returns how many were dropped.  Run before writing a snapshot.

    With ``keep_from_step``, rollouts consumed at that step or later keep their records:
    they are the ones a learner restored from the checkpoint taken before that step must be
    fed again, so they cannot be dropped until a newer checkpoint commits."""
    gone = [rid for rid, r in state.rollouts.items() if r.consumed_step is not None
            and (keep_from_step is None or r.consumed_step < keep_from_step)]
    for rid in gone:
        del state.rollouts[rid]
    return len(gone)


# --------------------------------------------------------------- serialization
def state_to_dict(state: JournalState) -> dict[str, Any]:
    """A JSON-ready image of ``state``; :func:`state_from_dict` inverts it exactly."""
    return {
        "applied": state.applied,
        "consumed": state.consumed,
        "consumed_again": state.consumed_again,
        "filtered": sorted(state.filtered),
        "kinds": state.kinds,
        "complete": state.complete,
        "anomalies": state.anomalies,
        "rollouts": [{
            "rollout_id": r.rollout_id, "dispatched": r.dispatched, "chunks": r.chunks,
            "observations": r.observations, "tool_calls": r.tool_calls,
            "tool_results": r.tool_results, "judgements": r.judgements,
            "completed": r.completed, "consumed_step": r.consumed_step,
            "history": [list(h) for h in r.history],
        } for r in state.rollouts.values()],
    }


def state_from_dict(data: dict[str, Any]) -> JournalState:
    """Rebuild a state from :func:`state_to_dict`'s image (after a JSON round trip).

    Raises KeyError/TypeError/ValueError on a malformed image; the journal turns those into
    ``JournalCorrupt``."""
    rollouts = {}
    for r in data["rollouts"]:
        record = RolloutRecord(
            rollout_id=str(r["rollout_id"]), dispatched=dict(r["dispatched"]),
            chunks=list(r["chunks"]), observations=list(r["observations"]),
            tool_calls=dict(r["tool_calls"]), tool_results=dict(r["tool_results"]),
            judgements=dict(r["judgements"]), completed=r["completed"],
            consumed_step=r["consumed_step"],
            history=[(str(kind), ref) for kind, ref in r["history"]])
        rollouts[record.rollout_id] = record
    return JournalState(rollouts=rollouts,
                        consumed={str(k): int(v) for k, v in data["consumed"].items()},
                        # Absent from snapshots written before they were kept.
                        consumed_again={str(k): [int(s) for s in v] for k, v in
                                        data.get("consumed_again", {}).items()},
                        filtered={str(r) for r in data.get("filtered", [])},
                        kinds={str(k): int(v) for k, v in data.get("kinds", {}).items()},
                        anomalies={str(k): int(v) for k, v in data["anomalies"].items()},
                        applied=int(data["applied"]),
                        complete="kinds" in data and bool(data.get("complete", True)))

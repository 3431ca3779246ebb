"""Invariants over the run's durable records: the learner's ledger against the journal,
the journal's tool results and judgements, and the committed checkpoints.

The ledger (:mod:`erlay.actors.learner.ledger`) is written by the learner, the journal by
the rollout coordinator: two witnesses.  Exactly-once compares them as multisets (a
:class:`~collections.Counter`), so a rollout trained twice is counted twice, never
collapsed by a set.  Pure functions of a :class:`RunObservation`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from erlay.actors.journal.state import AGAIN_AFTER_RESULT, DIFFERENT
from erlay.actors.journal.transitions import TransitionKind
from erlay.actors.learner.ledger import LedgerStep, effective_steps
from erlay.chaos.observation import (
    NO_JUDGEMENT,
    NO_STEP_TRAINED,
    NO_TOOL_CALL,
    RunObservation,
    Verdict,
    cannot_check,
    few,
    not_applicable,
    rollout_step,
)


def _ledger(obs: RunObservation, name: str) -> list[LedgerStep] | Verdict:
    """The effective ledger steps, or the FAIL verdict of an invariant that needs them."""
    if obs.ledger is None:
        return cannot_check(name, f"{obs.ledger_problem or 'the run has no learner ledger'} "
                                  "(ledger.jsonl)")
    try:
        return effective_steps(obs.ledger)
    except (KeyError, TypeError, ValueError) as exc:
        return cannot_check(name, f"the learner ledger is unreadable: {exc!r}")


def lost_rollouts(obs: RunObservation) -> list[str]:
    """Dispatched rollouts of trained steps that never reached CONSUMED in the journal."""
    consumed = {rid for rid, _ in obs.consumed_transitions}
    return sorted(r for r in obs.dispatched_ids
                  if (s := rollout_step(r)) is not None and s < obs.steps_trained
                  and r not in consumed)


def trained_twice(obs: RunObservation) -> list[str] | None:
    """Rollouts the learner's ledger shows fed more than once in its surviving timeline;
    None when the run has no (readable) ledger."""
    steps = _ledger(obs, "trained_twice")
    if isinstance(steps, Verdict):
        return None
    return sorted(rid for rid, n in _fed(steps).items() if n > 1)


def _fed(steps: list[LedgerStep]) -> Counter[str]:
    """How many times the ledger's steps fed each rollout id, trained or masked."""
    return Counter(rid for s in steps for rid in s.fed)


def _raw_fed(records: list[dict[str, Any]]) -> Counter[str]:
    """How many times the learner fed each rollout id in any timeline: every step record
    of the ledger, the ones a restore superseded included."""
    steps = effective_steps(r for r in records if r.get("event") != "start")
    return _fed(steps)


def _last_start(records: list[dict[str, Any]]) -> int:
    """The step the learner's latest incarnation began at (0 without a start record)."""
    starts = [int(r["step"]) for r in records if r.get("event") == "start"]
    return starts[-1] if starts else 0


def exactly_once(obs: RunObservation) -> Verdict:
    """Every rollout was fed to the learner exactly once in its surviving timeline (the
    ledger after restores), by the step its id names, and the journal's consumptions and the
    ledger's trainings agree, both counted as multisets, knowing about checkpoints:

    - fed twice in the surviving timeline, or by another step: a violation;
    - consumed in the journal more often than the learner trained it: a violation;
    - trained but never consumed in the journal: a violation when a checkpoint kept the step
      (a resume would restore it *and* feed it again); when no checkpoint kept it, the
      training died with the run (a resume restores the checkpoint before it and trains
      it again from the journal): reported, not a violation;
    - consumed but no longer in the surviving timeline: a violation when the learner's
      latest incarnation began after that step (its checkpoint should hold it) or the run
      finished; otherwise a restore superseded it and the run ended before training it
      again (a resume does): reported, not a violation;
    - consumed with weight 0 because dynamic sampling dropped its group (``filtered``) yet
      with a token in the learner's loss: a violation.  Filtered rollouts are counted apart.
    """
    name = "exactly_once"
    steps = _ledger(obs, name)
    if isinstance(steps, Verdict):
        return steps
    if (missing := _journal(obs, name)) is not None:
        return missing
    if obs.steps_trained > 0 and not obs.consumed_transitions:
        return cannot_check(name, "the journal recorded no consumed rollout")
    assert obs.ledger is not None   # _ledger returned steps
    fed, raw = _fed(steps), _raw_fed(obs.ledger)
    journal = Counter(rid for rid, _ in obs.consumed_transitions)
    kept, began = obs.kept_step(), _last_start(obs.ledger)
    misplaced = [f"{rid} by step {s.step}" for s in steps for rid in s.fed
                 if rollout_step(rid) != s.step]
    twice = sorted(f"{rid} x{n}" for rid, n in fed.items() if n > 1)
    over = sorted(f"{rid} ({n} consumptions, {raw[rid]} trainings)"
                  for rid, n in journal.items() if n > raw[rid])
    kept_unjournaled, lost, never, superseded = [], [], [], []
    for rid in sorted(set(fed) - set(journal)):
        step = rollout_step(rid) or 0
        (kept_unjournaled if step < kept else lost).append(rid)
    for rid in sorted(set(journal) - set(fed)):
        step = rollout_step(rid) or 0
        (never if step < began or obs.status == "finished" else superseded).append(rid)
    trained_filtered = sorted({rid for s in steps for rid, _ in s.trained}
                              & obs.filtered_ids)
    problems = []
    if twice:
        problems.append(f"fed to the learner more than once: {few(twice)}")
    if trained_filtered:
        problems.append(f"dropped by dynamic sampling (weight 0) but trained on: "
                        f"{few(trained_filtered)}")
    if misplaced:
        problems.append(f"fed by a step other than its id's: {few(sorted(misplaced))}")
    if over:
        problems.append(f"consumed in the journal more often than trained: {few(over)}")
    if kept_unjournaled:
        problems.append(f"trained into the checkpoint at step {kept} but never consumed in "
                        f"the journal (a resume would feed it again): {few(kept_unjournaled)}")
    if never:
        problems.append(f"consumed in the journal, never in the ledger: {few(never)}")
    if problems:
        return Verdict(name, False, "; ".join(problems))
    detail = (f"{sum(fed.values())} rollouts over {len(steps)} ledger steps, each fed once, "
              f"matching the journal ({sum(journal.values())} consumptions)")
    if obs.filtered_ids:
        detail += (f"; {len(obs.filtered_ids)} of them consumed with weight 0, their group "
                   f"dropped by dynamic sampling")
    if lost:
        detail += (f"; {len(lost)} trained after the last checkpoint (step {kept}) and lost "
                   f"with the run, to be trained again on resume: {few(lost, 3)}")
    if superseded:
        detail += (f"; {len(superseded)} superseded by the restore to step {began}, not yet "
                   f"trained again: {few(superseded, 3)}")
    return Verdict(name, True, detail)


def staleness_within_bound(obs: RunObservation) -> Verdict:
    """No *trained* sample (one with a token in the loss, by the learner's own ledger) was
    generated by weights more than ``max_staleness`` versions behind the learner that
    trained it.  Stale samples that were masked out are counted, and are fine."""
    name = "staleness_within_bound"
    steps = _ledger(obs, name)
    if isinstance(steps, Verdict):
        return steps
    if obs.steps_trained > 0 and not steps:
        return cannot_check(name, f"{obs.steps_trained} steps trained but the ledger holds none")
    over = [f"{rid} at step {s.step} (lag {s.version - v})" for s in steps
            for rid, v in s.trained if v >= 0 and s.version - v > obs.max_staleness]
    masked = sum(len(s.masked) for s in steps)
    if over:
        return Verdict(name, False, f"trained beyond the bound {obs.max_staleness}: "
                                    f"{few(over)}")
    worst = max((s.version - v for s in steps for _, v in s.trained if v >= 0),
                default=0)
    return Verdict(name, True, f"{sum(len(s.trained) for s in steps)} trained samples, worst "
                               f"lag {worst} <= {obs.max_staleness}; {masked} masked")


def steps_in_order(obs: RunObservation) -> Verdict:
    """The learner's surviving timeline trained steps 0, 1, 2, ... each once, in order (a
    restore rewinds it; what follows must continue from the restored step)."""
    name = "steps_in_order"
    steps = _ledger(obs, name)
    if isinstance(steps, Verdict):
        return steps
    order = [s.step for s in steps]
    if not order:
        if obs.steps_trained > 0:
            return cannot_check(name, f"{obs.steps_trained} steps trained but the ledger "
                                      "holds none")
        return not_applicable(name, NO_STEP_TRAINED)
    expected = list(range(order[0], order[0] + len(order)))
    if order != expected:
        first = next(i for i, (a, b) in enumerate(zip(order, expected, strict=True)) if a != b)
        return Verdict(name, False, f"step {order[first]} trained where step {expected[first]} "
                                    f"was due (order {few(order, 8)})")
    return Verdict(name, True, f"steps {order[0]}..{order[-1]} trained once each, in order")


def _journal(obs: RunObservation, name: str) -> Verdict | None:
    """None when the journal was read, else the FAIL verdict saying why it was not."""
    if obs.journal_found:
        return None
    return cannot_check(name, obs.journal_problem or "the run has no journal")


def tool_calls_once(obs: RunObservation) -> Verdict:
    """No tool call was executed again once its result was known: a replayed rollout reuses
    the journaled result of its idempotency key.  Violations: a TOOL_CALL of a key after a
    TOOL_RESULT of it, and two different TOOL_RESULTs of one key (equal ones are the
    sandbox's idempotency cache answering a call made before the result was journaled).
    Counted over the whole run by the journal's fold (its anomaly counts survive
    compaction); the keys are named from the segments still on disk."""
    name = "tool_calls_once"
    if (missing := _journal(obs, name)) is not None:
        return missing
    calls = obs.journal_kinds.get(TransitionKind.TOOL_CALL.value, 0)
    if not calls:
        return not_applicable(name, NO_TOOL_CALL)
    results: dict[str, Any] = {}
    again, differ = [], []
    for kind, key, result in obs.tool_events:
        if kind == "call" and key in results:
            again.append(key)
        elif kind == "result":
            if key in results and results[key] != result:
                differ.append(key)
            results.setdefault(key, result)
    n_again = max(len(again), _anomalies(obs, TransitionKind.TOOL_CALL, AGAIN_AFTER_RESULT))
    n_differ = max(len(differ), _anomalies(obs, TransitionKind.TOOL_RESULT, DIFFERENT))
    problems = []
    if n_again:
        problems.append(f"{n_again} called again after its result was journaled"
                        + _named(again))
    if n_differ:
        problems.append(f"{n_differ} with two different results for one key" + _named(differ))
    if problems:
        return Verdict(name, False, "; ".join(problems))
    return Verdict(name, True, f"{calls} tool calls journaled, none executed again")


def judgements_stable(obs: RunObservation) -> Verdict:
    """A judgement, once journaled, is never changed: a replay reuses it, so every JUDGED
    record of one key carries the same judgement.  Counted over the whole run by the
    journal's fold; the keys are named from the segments still on disk.  A run that judged
    nothing is N/A only when its metrics agree that the judge never failed a sample."""
    name = "judgements_stable"
    if (missing := _journal(obs, name)) is not None:
        return missing
    judged = obs.journal_kinds.get(TransitionKind.JUDGED.value, 0)
    if not judged:
        if obs.judge_failed:
            return cannot_check(name, f"the metrics count {obs.judge_failed} samples the "
                                      "judge failed, but the journal holds no judgement")
        return not_applicable(name, NO_JUDGEMENT)
    seen: dict[str, list[Any]] = defaultdict(list)
    for key, judgement in obs.judgements:
        seen[key].append(judgement)
    changed = sorted(k for k, js in seen.items() if any(j != js[0] for j in js[1:]))
    n_changed = max(len(changed), _anomalies(obs, TransitionKind.JUDGED, DIFFERENT))
    if n_changed:
        return Verdict(name, False, f"{n_changed} judgements changed on replay"
                                    + _named(changed))
    return Verdict(name, True, f"{judged} judgements journaled, none changed")


def _anomalies(obs: RunObservation, kind: TransitionKind, reason: str) -> int:
    return obs.journal_anomalies.get(f"{kind.value}: {reason}", 0)


def _named(keys: list[str]) -> str:
    return f" ({few(sorted(keys))})" if keys else " (keys compacted away)"


def checkpoints_intact(obs: RunObservation) -> Verdict:
    """Every committed checkpoint verifies: its manifest is complete and every file's
    content hash matches.  A torn checkpoint that looks committed is a violation."""
    name = "checkpoints_intact"
    if obs.checkpoints is None:
        return cannot_check(name, "the run's checkpoints were not listed")
    if obs.steps_trained > 0 and not obs.checkpoints:
        return cannot_check(name, f"{obs.steps_trained} steps trained but no checkpoint "
                                  "was committed")
    torn = [f"step {step}: {problem}" for step, problem in obs.checkpoints if problem]
    if torn:
        return Verdict(name, False, f"torn checkpoints: {few(torn, 3)}")
    return Verdict(name, True, f"{len(obs.checkpoints)} committed checkpoints verify")

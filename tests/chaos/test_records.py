"""The record invariants (learner ledger vs journal, tool results, judgements, checkpoints)
on hand-built runs: each holding, and each catching its planted violation.  No Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from erlay.actors.learner.ledger import LearnerLedger, effective_steps, read_ledger
from erlay.chaos.observation import RunObservation
from erlay.chaos.records import (
    checkpoints_intact,
    exactly_once,
    judgements_stable,
    staleness_within_bound,
    steps_in_order,
    tool_calls_once,
    trained_twice,
)


def rids(step: int, n: int = 2) -> list[str]:
    return [f"r{step:05d}-g000-{k}" for k in range(n)]


def start(step: int = 0) -> dict[str, Any]:
    return {"event": "start", "step": step, "restored": step > 0}


def trained(step: int, version: int | None = None, lag: int = 0,
            ids: list[str] | None = None, masked: list[str] | None = None) -> dict[str, Any]:
    v = step if version is None else version
    return {"step": step, "version": v, "trained": dict.fromkeys(ids or rids(step), v - lag),
            "masked": masked or []}


def run(ledger: list[dict[str, Any]], steps: int = 3, **kw: Any) -> RunObservation:
    consumed = [(r, s) for s in range(steps) for r in rids(s)]
    return RunObservation(ledger=ledger, consumed_transitions=consumed, steps_trained=steps,
                          dispatched_ids={r for r, _ in consumed}, **kw)


CLEAN = [start(), trained(0), trained(1, version=5, lag=1), trained(2)]


def test_a_clean_ledger_passes_every_ledger_invariant() -> None:
    obs = run(CLEAN)
    for check in (exactly_once, staleness_within_bound, steps_in_order):
        verdict = check(obs)
        assert verdict.ok is True, verdict


def test_a_rollout_trained_twice_is_caught_though_the_ids_are_the_same() -> None:
    planted = run([*CLEAN, trained(2)])    # step 2 fed again with no restore between
    verdict = exactly_once(planted)
    assert verdict.ok is False and "x2" in verdict.detail


def test_a_restore_supersedes_what_the_lost_incarnation_trained() -> None:
    # The learner trained 1 and 2, died, restored the checkpoint of step 1, trained 1, 2.
    ledger = [start(), trained(0), trained(1), trained(2), start(1), trained(1), trained(2)]
    assert [s.step for s in effective_steps(ledger)] == [0, 1, 2]
    assert exactly_once(run(ledger)).ok is True
    assert steps_in_order(run(ledger)).ok is True


def test_journal_and_ledger_must_agree_both_ways() -> None:
    missing = exactly_once(run([start(), trained(0), trained(1)]))
    assert missing.ok is False and "never in the ledger" in missing.detail
    moved = exactly_once(run([start(), trained(0), trained(1, ids=rids(2)),
                              trained(2, ids=rids(1))]))
    assert moved.ok is False and "other than its id's" in moved.detail
    over = run(CLEAN)
    over.consumed_transitions.append((rids(1)[0], 1))    # consumed twice, trained once
    verdict = exactly_once(over)
    assert verdict.ok is False and "more often than trained" in verdict.detail


def test_training_no_checkpoint_kept_is_lost_with_the_run_not_a_violation() -> None:
    """Step 3 trained, then the job died before the journal recorded it: with the newest
    checkpoint at step 3 (steps 0..2 kept) a resume restores it and trains step 3 again, so
    it is reported; with a checkpoint at step 4 that kept it, a resume would train it twice."""
    lost = exactly_once(run([*CLEAN, trained(3)], checkpoints=[(3, None)], status="failed"))
    assert lost.ok is True and "lost with the run" in lost.detail
    kept = exactly_once(run([*CLEAN, trained(3)], checkpoints=[(4, None)], status="failed"))
    assert kept.ok is False and "trained into the checkpoint at step 4" in kept.detail
    torn = exactly_once(run([*CLEAN, trained(3)], checkpoints=[(4, "sha256 differs")],
                            status="failed"))
    assert torn.ok is True      # a torn checkpoint kept nothing (checkpoints_intact fails it)


def test_training_a_restore_superseded_is_reported_until_trained_again() -> None:
    """The learner trained 0..2 (all journaled), died, restored step 1's checkpoint, and
    the run ended before step 1 was trained again: superseded, not lost; a finished run
    that never trained it again lost it."""
    ledger = [*CLEAN, start(1)]
    failed = exactly_once(run(ledger, status="failed"))
    assert failed.ok is True and "superseded by the restore to step 1" in failed.detail
    finished = exactly_once(run(ledger, status="finished"))
    assert finished.ok is False and "never in the ledger" in finished.detail


def test_a_trained_sample_over_the_bound_fails_and_a_masked_one_does_not() -> None:
    planted = run([start(), trained(0), trained(1, version=5, lag=2), trained(2)],
                  max_staleness=1)
    verdict = staleness_within_bound(planted)
    assert verdict.ok is False and "lag 2" in verdict.detail
    masked = run([start(), trained(0), trained(1, ids=[], masked=rids(1)), trained(2)],
                 max_staleness=0)
    assert staleness_within_bound(masked).ok is True


def test_a_step_out_of_order_fails() -> None:
    verdict = steps_in_order(run([start(), trained(0), trained(2), trained(1)]))
    assert verdict.ok is False and "step 2 trained where step 1 was due" in verdict.detail


def test_without_a_ledger_the_ledger_invariants_fail_as_cannot_check() -> None:
    for check in (exactly_once, staleness_within_bound, steps_in_order):
        verdict = check(run(None))  # type: ignore[arg-type]
        assert verdict.ok is False and verdict.detail.startswith("cannot check")


def tools(events: list[tuple[str, str, Any]], **kw: Any) -> RunObservation:
    return RunObservation(tool_events=events, journal_kinds={"tool_call": sum(
        1 for kind, _, _ in events if kind == "call")}, **kw)


def test_tool_calls_and_judgements() -> None:
    out = {"stdout": "4"}
    clean = [("call", "a/tool0", None), ("result", "a/tool0", out),
             ("call", "b/tool0", None), ("result", "b/tool0", out)]
    assert tool_calls_once(tools(clean)).ok is True
    # Two calls before any result, answered alike: the sandbox's idempotency cache.
    cached = [("call", "a/tool0", None), ("call", "a/tool0", None),
              ("result", "a/tool0", out), ("result", "a/tool0", out)]
    assert tool_calls_once(tools(cached)).ok is True
    again = tool_calls_once(tools([*clean, ("call", "a/tool0", None)]))
    assert again.ok is False and "called again after its result" in again.detail
    differ = tool_calls_once(tools([*cached[:3], ("result", "a/tool0", {"stdout": "5"})]))
    assert differ.ok is False and "two different results" in differ.detail
    same = [("a/judge", {"reward": 1.0}), ("a/judge", {"reward": 1.0})]
    judged = {"judged": 3}
    assert judgements_stable(RunObservation(judgements=same, journal_kinds=judged)).ok
    changed = judgements_stable(RunObservation(judgements=[*same, ("a/judge", {"reward": 0})],
                                               journal_kinds=judged))
    assert changed.ok is False and "a/judge" in changed.detail
    missing = RunObservation(journal_found=False)
    assert tool_calls_once(missing).ok is False
    assert judgements_stable(missing).ok is False


def test_a_violation_compacted_out_of_the_segments_still_fails_by_the_journals_counts(
) -> None:
    """The keys of a re-executed call or a changed judgement may be gone with compacted
    segments; the journal fold's anomaly counts, kept in every snapshot, still fail it."""
    again = tool_calls_once(RunObservation(journal_kinds={"tool_call": 2}, journal_anomalies={
        "tool_call: called again after its result was journaled": 1}))
    assert again.ok is False and "keys compacted away" in again.detail
    changed = judgements_stable(RunObservation(journal_kinds={"judged": 9}, journal_anomalies={
        "judged: key already has a different one": 2}))
    assert changed.ok is False and changed.detail.startswith("2 judgements changed")


def test_no_judgement_is_na_only_when_the_metrics_agree_the_judge_never_ran() -> None:
    from erlay.chaos.observation import NO_JUDGEMENT
    assert judgements_stable(RunObservation(steps_trained=3)).detail == NO_JUDGEMENT
    lost = judgements_stable(RunObservation(steps_trained=3, judge_failed=2))
    assert lost.ok is False and "cannot check" in lost.detail


def test_checkpoints() -> None:
    assert checkpoints_intact(RunObservation(checkpoints=[(0, None), (2, None)])).ok is True
    torn = checkpoints_intact(RunObservation(checkpoints=[(0, None), (2, "sha256 differs")]))
    assert torn.ok is False and "step 2" in torn.detail
    assert checkpoints_intact(RunObservation(steps_trained=3, checkpoints=[])).ok is False
    assert checkpoints_intact(RunObservation()).ok is False   # not listed: cannot check


def test_the_ledger_file_round_trips_and_ignores_only_a_torn_last_line(tmp_path: Path) -> None:
    ledger = LearnerLedger(tmp_path / "ledger.jsonl")
    ledger.started(0, False)
    ledger.trained(0, 5, ["r00000-g000-0", "r00000-g000-1"], [[5, 4, -1], [3]],
                   [[True, True, False], [False]])
    [step] = effective_steps(read_ledger(ledger.path))
    assert (step.step, step.version) == (0, 5)
    assert step.trained == (("r00000-g000-0", 4),) and step.masked == ("r00000-g000-1",)
    with open(ledger.path, "a") as f:
        f.write('{"step": 1, "vers')          # a crash mid-write
    assert len(read_ledger(ledger.path)) == 2
    with open(ledger.path, "a") as f:
        f.write('\n{"event": "start", "step": 0, "restored": true}\n')
    with pytest.raises(ValueError, match="not a ledger record"):
        read_ledger(ledger.path)               # a torn line that is not the last one


def test_the_counts_the_suite_table_shows() -> None:
    from erlay.chaos.records import lost_rollouts, trained_twice
    obs = run(CLEAN)
    assert lost_rollouts(obs) == [] and trained_twice(obs) == []
    obs.consumed_transitions.pop()               # the last rollout of step 2 never consumed
    assert lost_rollouts(obs) == [rids(2)[-1]]
    assert trained_twice(run([*CLEAN, trained(1)])) == rids(1)
    assert trained_twice(run(None)) is None      # type: ignore[arg-type]


def test_a_rollout_fed_twice_in_one_step_shows_twice_in_the_ledger(tmp_path: Path) -> None:
    """The ledger keeps one entry per row fed, so a duplicate inside one batch reaches the
    exactly-once check as a count of 2 (a dict keyed by rollout id collapsed it to 1)."""
    ledger = LearnerLedger(tmp_path / "ledger.jsonl")
    ledger.started(0, False)
    rid = "r00000-g000-0"
    ledger.trained(0, 1, [rid, rid, "r00000-g000-1"], [[0], [0], [0]], None)
    [step] = effective_steps(read_ledger(ledger.path))
    assert step.fed == [rid, rid, "r00000-g000-1"]
    assert trained_twice(RunObservation(ledger=read_ledger(ledger.path))) == [rid]


def test_a_ledger_written_before_with_a_dict_still_reads() -> None:
    [step] = effective_steps([{"step": 0, "version": 2, "trained": {"r00000-g000-0": 1},
                               "masked": []}])
    assert step.trained == (("r00000-g000-0", 1),)
    with pytest.raises(TypeError):
        effective_steps([{"step": 0, "version": 2, "trained": "r00000-g000-0"}])


def test_a_rollout_dropped_by_dynamic_sampling_must_not_be_trained() -> None:
    # Step 1's group was dropped (all rewards equal): fed with every token masked, and its
    # consumption says filtered.  Counted apart when it holds ...
    dropped = rids(1)
    masked_step = {"step": 1, "version": 1, "trained": {}, "masked": dropped}
    ok = run([start(), trained(0), masked_step, trained(2)], filtered_ids=set(dropped))
    verdict = exactly_once(ok)
    assert verdict.ok is True and "2 of them consumed with weight 0" in verdict.detail
    # ... and a violation when the learner trained on it anyway (a mask lost on the way).
    planted = run(CLEAN, filtered_ids=set(dropped))
    verdict = exactly_once(planted)
    assert verdict.ok is False and "dropped by dynamic sampling" in verdict.detail

"""The chaos invariants on hand-built runs: each one holding, and each one broken.  No Ray."""

from __future__ import annotations

import pytest

from erlay.chaos.faults import FaultRecord, InvalidFaultRecord, domain_of
from erlay.chaos.invariants import (
    INVARIANTS,
    RunObservation,
    check_all,
    expected_end,
    faults_detected,
    faults_injected,
    final_reward,
    match_fault,
    no_duplicate_consumption,
    no_orphans,
    no_rollout_lost,
    replay_identical,
    restart_intensity_respected,
    reward_within_tolerance,
    rollout_step,
    samples_judged,
)
from erlay.chaos.records import steps_in_order
from erlay.supervisor.events import EventKind, SupervisorEvent

T0 = 1_000.0  # unix time of the first fault in these scenarios


def ev(supervisor: str, child: str | None, kind: EventKind, t: float,
       reason: str = "error: actor process died") -> SupervisorEvent:
    return SupervisorEvent(supervisor, child, kind, reason, 0, t)


def rl(step: int, **fields: object) -> dict[str, object]:
    return {"phase": "rl", "step": step, "samples": 8, "reward_mean": 0.5,
            "staleness_max": 0, "tokens_digest": f"d{step}", **fields}


def fault(target: str = "erlay/generation/engine-1", *, kind: str = "sigkill",
          domain: str | None = None, at: float = T0, expect: str = "restart",
          fid: int = 0) -> FaultRecord:
    return FaultRecord(id=fid, kind=kind, target=target,
                       domain=domain or domain_of(target), at=at, expect=expect)


def rids(step: int, n: int = 2) -> list[str]:
    return [f"r{step:05d}-g000-{k}" for k in range(n)]


# ------------------------------------------------------------------------- FaultRecord

def test_fault_record_round_trips_through_dict() -> None:
    record = FaultRecord(3, "sigstop", "erlay/learner/learner-0", "learner", T0, "restart",
                         "pid 42")
    assert FaultRecord.from_dict(record.to_dict()) == record


@pytest.mark.parametrize(("field", "value"), [("kind", "meteor"), ("domain", "gpu"),
                                              ("expect", "maybe"), ("id", -1),
                                              ("at", "yesterday"), ("target", "")])
def test_fault_record_rejects_bad_field_by_name(field: str, value: object) -> None:
    data = fault().to_dict() | {field: value}
    with pytest.raises(InvalidFaultRecord) as err:
        FaultRecord.from_dict(data)
    assert err.value.field == field
    assert isinstance(err.value, ValueError)


def test_fault_record_from_dict_rejects_missing_and_unknown_keys() -> None:
    data = fault().to_dict()
    with pytest.raises(InvalidFaultRecord, match="expect"):
        FaultRecord.from_dict({k: v for k, v in data.items() if k != "expect"})
    with pytest.raises(InvalidFaultRecord, match="tagret"):
        FaultRecord.from_dict(data | {"tagret": "x"})


def test_domain_of_reads_second_segment() -> None:
    assert domain_of("erlay/generation/engine-1") == "generation"
    assert domain_of("erlay") == "root"
    assert domain_of("driver") == "driver"


# ------------------------------------------------------------------------ exactly once

def test_rollout_step_parses_id() -> None:
    assert rollout_step("r00042-g003-1") == 42
    assert rollout_step("chaos-1") is None


def test_every_dispatched_rollout_consumed_passes() -> None:
    obs = RunObservation(dispatched_ids={*rids(0), *rids(1), *rids(2)}, steps_trained=2,
                         consumed_transitions=[(r, 0) for r in rids(0)]
                         + [(r, 1) for r in rids(1)])
    verdict = no_rollout_lost(obs)
    assert verdict.ok is True, verdict.detail  # step 2 was generated ahead, never due


def test_lost_rollout_fails_and_is_named() -> None:
    obs = RunObservation(dispatched_ids={*rids(0), *rids(1)}, steps_trained=2,
                         consumed_transitions=[(r, 0) for r in rids(0)]
                         + [("r00001-g000-0", 1)])
    verdict = no_rollout_lost(obs)
    assert verdict.ok is False
    assert "r00001-g000-1" in verdict.detail


def test_no_dispatch_record_fails_as_cannot_check() -> None:
    verdict = no_rollout_lost(RunObservation(steps_trained=3))
    assert verdict.ok is False and verdict.detail.startswith("cannot check")
    assert "journal" in verdict.detail


def test_refeed_of_same_step_is_not_a_duplicate() -> None:
    consumed = [(r, 0) for r in rids(0)] * 2 + [(r, 1) for r in rids(1)]
    verdict = no_duplicate_consumption(RunObservation(consumed_transitions=consumed))
    assert verdict.ok is True, verdict.detail
    assert "2 re-feeds" in verdict.detail


def test_rollout_consumed_by_two_steps_fails() -> None:
    consumed = [("r00001-g000-0", 1), ("r00001-g000-0", 2)]
    verdict = no_duplicate_consumption(RunObservation(consumed_transitions=consumed))
    assert verdict.ok is False
    assert "r00001-g000-0 by steps 1/2" in verdict.detail


def test_rollout_consumed_by_other_step_than_its_id_fails() -> None:
    verdict = no_duplicate_consumption(RunObservation(
        consumed_transitions=[("r00003-g000-0", 4)]))
    assert verdict.ok is False
    assert "r00003-g000-0 by step 4" in verdict.detail


# ------------------------------------------------------------------ staleness, replay

def test_replay_identical_passes_including_refed_steps() -> None:
    clean = RunObservation(metrics=[rl(0), rl(1), rl(2)], max_staleness=0)
    obs = RunObservation(metrics=[rl(0), rl(1), {"phase": "rewind"}, rl(1), rl(2)],
                         max_staleness=0)
    verdict = replay_identical(obs, clean)
    assert verdict.ok is True, verdict.detail
    assert "4 step records" in verdict.detail


def test_digest_mismatch_fails_naming_step() -> None:
    clean = RunObservation(metrics=[rl(0), rl(1)], max_staleness=0)
    obs = RunObservation(metrics=[rl(0), rl(1, tokens_digest="other")], max_staleness=0)
    verdict = replay_identical(obs, clean)
    assert verdict.ok is False
    assert "steps 1" in verdict.detail


def test_replay_skipped_without_fault_free_run_or_with_staleness() -> None:
    assert replay_identical(RunObservation(max_staleness=0)).ok is None
    clean = RunObservation(metrics=[rl(0)], max_staleness=1)
    obs = RunObservation(metrics=[rl(0, tokens_digest="other")], max_staleness=1)
    verdict = replay_identical(obs, clean)
    assert verdict.ok is None
    assert "policy version" in verdict.detail


# --------------------------------------------------------------------------- detection

def test_killed_engine_detected_by_its_exit() -> None:
    obs = RunObservation(faults=[fault()], events=[
        ev("erlay/generation", "engine-1", EventKind.EXIT, T0 + 0.2)])
    verdict = faults_detected(obs)
    assert verdict.ok is True, verdict.detail
    assert "exit of erlay/generation/engine-1 after 200 ms" in verdict.detail


def test_hang_detects_a_stopped_child() -> None:
    obs = RunObservation(faults=[fault(kind="sigstop")], events=[
        ev("erlay/generation", "engine-1", EventKind.HANG, T0 + 12, "hang: decode step")])
    assert faults_detected(obs).ok is True


def test_fault_with_no_exit_of_its_target_is_undetected() -> None:
    # An exit of another engine and one of the target long after the window do not count.
    obs = RunObservation(faults=[fault()], events=[
        ev("erlay/generation", "engine-0", EventKind.EXIT, T0 + 1),
        ev("erlay/generation", "engine-1", EventKind.EXIT, T0 + 31)])
    verdict = faults_detected(obs)
    assert verdict.ok is False
    assert "undetected" in verdict.detail and "erlay/generation/engine-0" in verdict.detail


def test_exit_before_the_fault_does_not_detect_it() -> None:
    obs = RunObservation(faults=[fault()], events=[
        ev("erlay/generation", "engine-1", EventKind.EXIT, T0 - 5)])
    assert faults_detected(obs).ok is False


def test_fault_attributed_to_wrong_domain_fails() -> None:
    obs = RunObservation(faults=[fault("erlay/generation/engine-1", domain="learner")],
                         events=[ev("erlay/generation", "engine-1", EventKind.EXIT, T0 + 0.1)])
    verdict = faults_detected(obs)
    assert verdict.ok is False
    assert "attributed to generation, expected learner" in verdict.detail


def test_glob_target_and_hosted_worker_match() -> None:
    glob = fault("erlay/judge/host@*", kind="failpoint", fid=0)
    assert glob.domain == "judge"
    hosted = fault("erlay/sandbox/host@node-0", fid=1, at=T0 + 50)
    obs = RunObservation(faults=[glob, hosted], events=[
        ev("erlay/judge/host@node-0", "worker-1", EventKind.EXIT, T0 + 1),
        ev("erlay/sandbox/host@node-0", "worker-3", EventKind.EXIT, T0 + 50.5)])
    verdict = faults_detected(obs)
    assert verdict.ok is True, verdict.detail


def test_expected_escalation_needs_an_escalation_in_the_domain() -> None:
    f = fault(expect="escalation")
    escalated = RunObservation(faults=[f], events=[
        ev("erlay/generation", "engine-1", EventKind.ESCALATION, T0 + 90,
           "shutdown: reached_max_restart_intensity")])
    assert faults_detected(escalated).ok is True
    elsewhere = RunObservation(faults=[f], events=[
        ev("erlay/learner", "learner-0", EventKind.ESCALATION, T0 + 1)])
    assert faults_detected(elsewhere).ok is False


def test_absorbed_fault_must_not_take_a_domain_down() -> None:
    attack = fault("erlay/sandbox/host@node-0", kind="sandbox_attack", expect="absorbed")
    worker_exit = ev("erlay/sandbox/host@node-0", "worker-0", EventKind.EXIT, T0 + 1)
    assert faults_detected(RunObservation(faults=[attack], events=[worker_exit])).ok is True
    domain_exit = ev("erlay", "sandbox", EventKind.EXIT, T0 + 2, "shutdown: reached_max")
    verdict = faults_detected(RunObservation(faults=[attack], events=[worker_exit,
                                                                      domain_exit]))
    assert verdict.ok is False
    assert "not_absorbed" in verdict.detail and "erlay/sandbox" in verdict.detail


def test_driver_fault_is_unchecked_not_passed() -> None:
    obs = RunObservation(faults=[fault("driver", kind="driver_kill", domain="driver")])
    verdict = faults_detected(obs)
    assert verdict.ok is None and "unchecked" in verdict.detail


def test_match_fault_reports_latency_of_first_hit() -> None:
    match = match_fault(fault(), [
        ev("erlay/generation", "engine-1", EventKind.EXIT, T0 + 0.5),
        ev("erlay/generation", "engine-1", EventKind.EXIT, T0 + 0.25)])
    assert match.latency_s == pytest.approx(0.25)


# ---------------------------------------------------------------------------- the tree

GEN = {"erlay/generation": (1, 5.0)}


def test_restarts_within_intensity_pass() -> None:
    obs = RunObservation(intensity=GEN, events=[
        ev("erlay/generation", "engine-1", EventKind.RESTART, T0),
        ev("erlay/generation", "engine-1", EventKind.RESTART, T0 + 6)])  # outside the period
    assert restart_intensity_respected(obs).ok is True


def test_too_many_restarts_without_escalation_fail() -> None:
    obs = RunObservation(intensity=GEN, events=[
        ev("erlay/generation", "engine-1", EventKind.RESTART, T0),
        ev("erlay/generation", "engine-0", EventKind.RESTART, T0 + 2)])
    verdict = restart_intensity_respected(obs)
    assert verdict.ok is False
    assert "instead of escalating" in verdict.detail


def test_escalation_when_intensity_exceeded_passes() -> None:
    obs = RunObservation(intensity=GEN, events=[
        ev("erlay/generation", "engine-1", EventKind.RESTART, T0),
        ev("erlay/generation", "engine-1", EventKind.ESCALATION, T0 + 2)])
    assert restart_intensity_respected(obs).ok is True


def test_escalation_before_intensity_reached_fails() -> None:
    obs = RunObservation(intensity={"erlay/generation": (2, 5.0)}, events=[
        ev("erlay/generation", "engine-1", EventKind.RESTART, T0),
        ev("erlay/generation", "engine-1", EventKind.ESCALATION, T0 + 1)])
    verdict = restart_intensity_respected(obs)
    assert verdict.ok is False and "escalated after 1" in verdict.detail


def test_supervisor_restarted_by_parent_starts_a_fresh_count() -> None:
    # The root (one_for_all) restarts every domain after the learner escalated: the new
    # generation supervisor owes nothing to its predecessor's restart.
    obs = RunObservation(intensity=GEN, events=[
        ev("erlay/generation", "engine-1", EventKind.RESTART, T0),
        ev("erlay/learner", "learner-0", EventKind.ESCALATION, T0 + 0.5),
        ev("erlay", "generation", EventKind.START, T0 + 1, "started"),
        ev("erlay/generation", "engine-1", EventKind.RESTART, T0 + 2)])
    assert restart_intensity_respected(obs).ok is True


def test_escalation_starts_a_fresh_count() -> None:
    obs = RunObservation(intensity=GEN, events=[
        ev("erlay/generation", "engine-1", EventKind.RESTART, T0),
        ev("erlay/generation", "engine-1", EventKind.ESCALATION, T0 + 1),
        ev("erlay/generation", "engine-1", EventKind.RESTART, T0 + 3)])
    assert restart_intensity_respected(obs).ok is True


def test_intensity_zero_demands_escalation_at_first_failure() -> None:
    obs = RunObservation(intensity={"erlay/learner": (0, 5.0)}, events=[
        ev("erlay/learner", "learner-0", EventKind.RESTART, T0)])
    assert restart_intensity_respected(obs).ok is False


def test_unknown_intensity_cannot_check_and_fails() -> None:
    verdict = restart_intensity_respected(RunObservation())
    assert verdict.ok is False and verdict.status == "FAIL" and "cannot check" in verdict.detail


def test_no_events_at_all_cannot_check_and_fails() -> None:
    """A missing events.jsonl reads as no events; a tree that ran wrote its start events, so
    "0 restarts" would be a pass on no evidence."""
    verdict = restart_intensity_respected(RunObservation(intensity=GEN, events=[]))
    assert verdict.ok is False and "events.jsonl" in verdict.detail


def test_no_consumed_rollout_and_no_ledger_step_fail_when_steps_trained() -> None:
    verdict = no_duplicate_consumption(RunObservation(steps_trained=2))
    assert verdict.ok is False and verdict.detail.startswith("cannot check")
    assert no_duplicate_consumption(RunObservation()).ok is None   # nothing trained: N/A
    ledger = [{"event": "start", "step": 0, "restored": False}]
    verdict = steps_in_order(RunObservation(steps_trained=2, ledger=ledger))
    assert verdict.ok is False and verdict.detail.startswith("cannot check")
    assert steps_in_order(RunObservation(ledger=ledger)).ok is None


def test_orphans() -> None:
    assert no_orphans(RunObservation()).ok is True
    verdict = no_orphans(RunObservation(orphans=[{"pid": 4242, "cmdline": "python engine"}]))
    assert verdict.ok is False and "4242" in verdict.detail


# ----------------------------------------------------------------------------- outcome

def test_final_reward_is_mean_of_last_tenth_of_distinct_steps() -> None:
    metrics = [rl(s, reward_mean=s / 20) for s in range(20)] + [rl(19, reward_mean=0.0)]
    # last 2 distinct steps: 18 -> 0.9, 19 -> 0.0 (its last record)
    assert final_reward(metrics) == pytest.approx(0.45)
    assert final_reward([]) is None


def test_reward_within_tolerance_passes_and_fails() -> None:
    clean = RunObservation(metrics=[rl(0, reward_mean=0.8)])
    near = RunObservation(metrics=[rl(0, reward_mean=0.75)])
    far = RunObservation(metrics=[rl(0, reward_mean=0.5)])
    assert reward_within_tolerance(near, clean, 0.1).ok is True
    verdict = reward_within_tolerance(far, clean, 0.1)
    assert verdict.ok is False and "0.300 > 0.1" in verdict.detail
    assert reward_within_tolerance(far).ok is None


def test_expected_end() -> None:
    assert expected_end(RunObservation()).ok is True
    assert expected_end(RunObservation(status="stalled")).ok is False
    failed = RunObservation(status="failed", offender="erlay/generation/engine-1")
    assert expected_end(failed, "escalation", "erlay/generation/*").ok is True
    assert expected_end(failed, "escalation", "erlay/learner/*").ok is False
    assert expected_end(RunObservation(), "escalation").ok is False
    with pytest.raises(ValueError, match="expect_end"):
        expected_end(failed, "explode")


def test_check_all_runs_every_invariant_in_order() -> None:
    obs = RunObservation(dispatched_ids=set(rids(0)), steps_trained=1, metrics=[rl(0)],
                         consumed_transitions=[(r, 0) for r in rids(0)],
                         intensity={"erlay": (3, 60.0)}, checkpoints=[(0, None)],
                         events=[ev("erlay", "learner", EventKind.START, T0, "started")],
                         ledger=[{"event": "start", "step": 0, "restored": False},
                                 {"step": 0, "version": 0, "trained": dict.fromkeys(rids(0), 0),
                                  "masked": []}])
    verdicts = check_all(obs)
    assert [v.name for v in verdicts] == list(INVARIANTS)
    assert all(v.ok is not False for v in verdicts), [v for v in verdicts if v.ok is False]
    # N/A only where the invariant does not apply: no baseline, no fault.
    assert {v.name for v in verdicts if v.ok is None} == {
        "replay_identical", "reward_within_tolerance", "faults_detected",
        "tool_calls_once", "judgements_stable"}  # the journal holds neither kind
    assert all(v.status == "N/A" for v in verdicts if v.ok is None)


def test_check_all_fails_every_record_invariant_without_its_evidence() -> None:
    """A run with steps but no ledger, journal or checkpoint listing passes nothing it could
    not check."""
    obs = RunObservation(dispatched_ids=set(rids(0)), steps_trained=1, metrics=[rl(0)],
                         consumed_transitions=[(r, 0) for r in rids(0)],
                         journal_found=False)
    failed = {v.name for v in check_all(obs) if v.ok is False}
    assert {"exactly_once", "staleness_within_bound", "steps_in_order", "tool_calls_once",
            "judgements_stable", "checkpoints_intact"} <= failed


def test_check_all_selects_and_rejects_unknown_names() -> None:
    verdicts = check_all(RunObservation(orphans=[{"pid": 1}]), selected=["no_orphans"])
    assert [(v.name, v.status) for v in verdicts] == [("no_orphans", "FAIL")]
    with pytest.raises(ValueError, match="no_orphan"):
        check_all(RunObservation(), selected=["no_orphan"])


def test_a_domain_ending_with_the_job_does_not_break_an_absorbed_fault() -> None:
    attack = fault("erlay/sandbox/host@node-0", kind="sandbox_attack", expect="absorbed")
    end = ev("erlay", "rollout", EventKind.EXIT, T0 + 2, "shutdown: auto_shutdown")
    assert faults_detected(RunObservation(faults=[attack], events=[end])).ok is True


def test_a_fault_that_could_not_be_injected_fails_the_run() -> None:
    assert faults_injected(RunObservation(faults=[fault()])).ok is True
    planted = RunObservation(faults=[], not_injected=[
        "faults.0 (sigkill erlay/generation/engine-*): LookupError: no running child"])
    verdict = faults_injected(planted)
    assert verdict.ok is False and "LookupError" in verdict.detail


def test_samples_judged_holds_at_the_share_and_fails_below_it() -> None:
    good = RunObservation(metrics=[rl(0, samples=100, judge_failed=4)])
    assert samples_judged(good, 0.95).ok is True
    planted = RunObservation(metrics=[rl(0, samples=100, judge_failed=24)])
    verdict = samples_judged(planted, 0.95)
    assert verdict.ok is False and "76 of the 100 samples" in verdict.detail


def test_samples_judged_leaves_the_judges_own_failures_out_of_the_share() -> None:
    """A judge failing 15% of its inputs of its own cause: the others are all judged."""
    own = RunObservation(metrics=[rl(0, samples=100, judge_failed=15, judge_own=15)])
    verdict = samples_judged(own, 0.95)
    assert verdict.ok is True and "15 of 15 judge failures carry their own cause" in verdict.detail


def test_samples_judged_fails_when_the_judges_own_failures_knock_out_healthy_ones() -> None:
    """Planted: the judge's own failures trip a breaker, so healthy samples fail as
    "unavailable" (the bug this invariant exists for)."""
    tripped = RunObservation(metrics=[rl(0, samples=100, judge_failed=40, judge_own=15)])
    verdict = samples_judged(tripped, 0.95)
    assert verdict.ok is False
    assert "60 of the 85 samples" in verdict.detail and "15 of 40 judge failures" in verdict.detail
    assert samples_judged(RunObservation(), 0.95).ok is False  # nothing to judge by

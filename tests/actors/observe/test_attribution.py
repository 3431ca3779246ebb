"""Failure attribution as pure functions: hand-written events with known answers."""

from __future__ import annotations

import pytest

from erlay.actors.observe.attribution import (
    OTHER,
    Cause,
    Failure,
    StepWindow,
    attribution_rows,
    domain_of,
    domain_rows,
    exit_cause,
    failures_from_events,
    job_start,
    share_line,
    step_windows,
    time_lost,
    whole_percents,
)
from erlay.supervisor.events import EventKind, SupervisorEvent

T0 = 1_000_000.0  # the job start, unix seconds
GEN, HOST = "erlay/generation", "erlay/sandbox/host@node-0"


def ev(t: float, sup: str, child: str | None, kind: str, reason: str = "") -> SupervisorEvent:
    return SupervisorEvent(sup, child, EventKind(kind), reason or kind, 0, T0 + t)


def multi_domain_events() -> list[SupervisorEvent]:
    """Two engine kills (recovered after 2 s and 6 s) and one sandbox hang (after 3 s)."""
    return [
        ev(0, GEN, "engine-0", "start", "started"), ev(0, GEN, "engine-1", "start", "started"),
        ev(0, HOST, "sandbox-1", "start", "started"),
        ev(10, GEN, "engine-0", "exit", "killed"), ev(10, GEN, "engine-0", "restart", "killed"),
        ev(12, GEN, "engine-0", "start", "started"),
        ev(20, GEN, "engine-1", "exit", "error: RuntimeError: CUDA error"),
        ev(26, GEN, "engine-1", "start", "started"),
        ev(30, HOST, "sandbox-1", "hang", "tool_call: no progress for 15.0 s"),
        ev(30.5, HOST, "sandbox-1", "exit", "hang: tool_call: no progress for 15.0 s"),
        ev(33, HOST, "sandbox-1", "start", "started"),
        ev(40, "erlay", None, "shutdown", "shutdown"),
        ev(40, GEN, "engine-0", "exit", "shutdown"),
    ]


def test_two_generation_kills_and_a_sandbox_hang_split_67_33() -> None:
    failures = failures_from_events(multi_domain_events())
    lost = time_lost(failures, [], T0)
    domains = domain_rows(failures, lost)
    assert [(r.domain, r.failures) for r in domains] == [("generation", 2), ("sandbox", 1)]
    assert share_line(domains) == "generation 67%, sandbox 33%"
    assert domains[0].share_pct == pytest.approx(200 / 3)
    assert domains[0].mean_recovery_s == pytest.approx(4.0)  # (2 + 6) / 2
    assert domains[1].mean_recovery_s == pytest.approx(3.0)  # from the hang, not the kill
    rows = attribution_rows(failures, lost)
    assert [(r.domain, r.cause, r.failures) for r in rows] == [
        ("generation", Cause.KILLED, 1), ("generation", Cause.ERROR, 1),
        ("sandbox", Cause.HANG, 1)]


def test_hang_and_the_kill_that_answers_it_count_once_dated_at_the_hang() -> None:
    failures = failures_from_events(multi_domain_events())
    sandbox = [f for f in failures if f.domain == "sandbox"]
    assert len(sandbox) == 1
    assert sandbox[0].cause is Cause.HANG and sandbox[0].time == T0 + 30
    assert sandbox[0].path == "erlay/sandbox/host@node-0/sandbox-1"


def test_normal_and_shutdown_exits_are_not_failures() -> None:
    events = [ev(0, GEN, "engine-0", "start"), ev(5, "erlay", "rollout", "exit", "normal"),
              ev(6, "erlay", "generation", "exit",
                 "shutdown: reached_max_restart_intensity (3 restart(s) in 5 s) "
                 "(offender erlay/generation/engine-0 <- killed)"),
              ev(7, GEN, "engine-0", "exit", "shutdown"),
              ev(8, GEN, None, "escalation", "shutdown: reached_max_restart_intensity")]
    assert failures_from_events(events) == []


def test_failure_never_restarted_is_unrecovered_and_left_out_of_the_mean() -> None:
    events = [ev(1, GEN, "engine-0", "exit", "killed"), ev(2, GEN, "engine-0", "start"),
              ev(5, GEN, "engine-0", "exit", "lost: node died")]
    failures = failures_from_events(events)
    assert [f.recovery_s for f in failures] == [pytest.approx(1.0), None]
    (row,) = domain_rows(failures, time_lost(failures, [], T0))
    assert row.mean_recovery_s == pytest.approx(1.0) and row.unrecovered == 1


def test_start_error_is_a_failure_and_the_next_start_recovers_both() -> None:
    events = [ev(1, GEN, "engine-0", "exit", "killed"),
              ev(2, GEN, "engine-0", "start_error", "RuntimeError: port in use"),
              ev(4, GEN, "engine-0", "start")]
    failures = failures_from_events(events)
    assert [f.cause for f in failures] == [Cause.KILLED, Cause.START_ERROR]
    assert [f.recovery_s for f in failures] == [pytest.approx(3.0), pytest.approx(2.0)]


def test_domain_is_the_component_after_the_root() -> None:
    assert domain_of(HOST, "sandbox-1") == "sandbox"
    assert domain_of("erlay", "generation") == "generation"
    assert domain_of("erlay/judge/host@node-1", "judge-2") == "judge"
    assert domain_of("erlay", None) == OTHER
    assert domain_of("erlay/metrics", "exporter") == OTHER


@pytest.mark.parametrize(("reason", "cause"), [
    ("killed", Cause.KILLED), ("error: ValueError: x", Cause.ERROR),
    ("hang: decode_step: no progress", Cause.HANG), ("lost: node died", Cause.LOST),
    ("normal", None), ("shutdown", None), ("shutdown: auto_shutdown", None),
    ("shutdown (offender erlay/x)", None), ("", Cause.UNKNOWN), ("¿?", Cause.UNKNOWN)])
def test_exit_cause_reads_the_reason_kind(reason: str, cause: Cause | None) -> None:
    assert exit_cause(reason) is cause


def rl(t: float, step: int, step_s: float = 1.0, **extra: float) -> dict[str, object]:
    return {"phase": "rl", "step": step, "time": t, "step_s": step_s, **extra}


def test_a_step_window_runs_from_the_previous_step_the_first_from_its_step_s() -> None:
    windows = step_windows([rl(10, 0, 1.5), rl(11, 1, 0.2), rl(15, 2, 0.3)], T0)
    assert windows == [StepWindow(0, 8.5, 10), StepWindow(1, 10, 11), StepWindow(2, 11, 15)]


def test_a_resumed_segment_is_shifted_by_its_own_started_at_and_skips_the_outage() -> None:
    # The driver died after step 0 (at 10 s) and was resumed at 100 s: step 1's window is
    # its own step_s, not the 95 s outage before it.
    records = [rl(10, 0, started_at=T0), rl(5, 1, started_at=T0 + 100),
               rl(7, 2, started_at=T0 + 100)]
    assert [(w.start, w.end) for w in step_windows(records, T0)] == [(9, 10), (104, 105),
                                                                     (105, 107)]


def test_time_going_backwards_without_started_at_falls_back_to_step_s() -> None:
    windows = step_windows([rl(10, 0), rl(4, 1, 0.5)], T0)
    assert windows[1] == StepWindow(1, 3.5, 4)


def failure(t: float, domain: str = "generation", cause: Cause = Cause.KILLED) -> Failure:
    return Failure(T0 + t, "erlay/" + domain, "c", domain, cause, cause.value, T0 + t + 1)


def test_time_lost_is_the_excess_over_the_median_clean_step_split_equally() -> None:
    # Windows of 1, 1, 1, 4 (holding two failures) and 2 s: the clean median is 1 s.
    windows = step_windows([rl(10, 0), rl(11, 1), rl(12, 2), rl(16, 3), rl(18, 4)], T0)
    failures = [failure(13), failure(14, "sandbox", Cause.HANG), failure(2)]
    lost = time_lost(failures, windows, T0)
    assert lost.baseline_s == pytest.approx(1.0)
    assert lost.costs == pytest.approx((1.5, 1.5, 0.0))
    assert (lost.steps_hit, lost.outside) == (1, 1)
    assert lost.rl_wall_s == pytest.approx(9.0)
    rows = {r.domain: r for r in domain_rows(failures, lost)}
    assert rows["sandbox"].cost_s == pytest.approx(1.5)
    assert rows["sandbox"].cost_pct == pytest.approx(100 * 1.5 / 9)


def test_a_failure_on_a_window_boundary_belongs_to_the_step_that_ends_there() -> None:
    windows = step_windows([rl(10, 0), rl(11, 1), rl(14, 2)], T0)
    lost = time_lost([failure(11)], windows, T0)
    assert lost.costs == (0.0,)  # step 1 (10, 11] is exactly the clean median
    assert lost.steps_hit == 1


def test_when_every_step_failed_the_smallest_window_is_the_baseline() -> None:
    windows = step_windows([rl(10, 0, 2.0), rl(13, 1)], T0)
    lost = time_lost([failure(9), failure(12)], windows, T0)
    assert lost.baseline_s == pytest.approx(2.0)
    assert lost.costs == pytest.approx((0.0, 1.0))


def test_job_start_prefers_metrics_then_a_recorded_start_then_the_first_event() -> None:
    events = multi_domain_events()
    assert job_start([{"phase": "rl"}, {"started_at": T0 - 5}], events, T0 - 9) == (
        T0 - 5, "metrics.jsonl started_at")
    assert job_start([], events, T0 - 9)[0] == T0 - 9
    start, source = job_start([], events)
    assert start == T0 and source.startswith("estimated")
    assert job_start([], [])[0] is None


def test_whole_percents_sum_to_100() -> None:
    assert whole_percents([1, 1, 1]) == [34, 33, 33]
    assert whole_percents([56, 36, 8]) == [56, 36, 8]
    assert whole_percents([2, 1]) == [67, 33]
    assert whole_percents([]) == []

"""Pure failure-detection decisions: hangs and quarantine, with a fake clock."""

from __future__ import annotations

from erlay.supervisor.health import Health, Quarantine, hang_verdict, observe, quarantine_verdict
from erlay.supervisor.progress import Progress, ProgressSnapshot

DEADLINES = {"decode_step": 2.0, "tool_call": 10.0}


def test_holding_work_without_progress_past_the_deadline_is_a_hang() -> None:
    h = observe(Health.new(0.0), ProgressSnapshot(5, "decode_step", "r-1"), 0.0)
    h = observe(h, ProgressSnapshot(5, "decode_step", "r-1"), 2.5)
    verdict = hang_verdict(h, DEADLINES, 2.5)
    assert verdict is not None and "decode_step on r-1" in verdict


def test_ticking_counter_is_progress() -> None:
    h = Health.new(0.0)
    for t in range(10):
        h = observe(h, ProgressSnapshot(t, "decode_step", None), float(t))
    assert hang_verdict(h, DEADLINES, 9.5) is None


def test_idle_child_is_never_hung_while_it_answers() -> None:
    h = observe(Health.new(0.0), ProgressSnapshot(3, None, None), 100.0)
    assert hang_verdict(h, DEADLINES, 100.0) is None


def test_each_phase_has_its_own_deadline() -> None:
    h = observe(Health.new(0.0), ProgressSnapshot(1, "tool_call", None), 0.0)
    h = observe(h, ProgressSnapshot(1, "tool_call", None), 5.0)
    assert hang_verdict(h, DEADLINES, 5.0) is None


def test_unanswered_polls_past_the_largest_deadline_are_a_hang() -> None:
    h = observe(Health.new(0.0), ProgressSnapshot(1, None, None), 0.0)
    verdict = hang_verdict(h, DEADLINES, 10.5)  # no answer since t=0: a stopped process
    assert verdict is not None and "unresponsive" in verdict


def test_no_deadlines_means_no_hang_detection() -> None:
    assert hang_verdict(Health.new(0.0), {}, 1e9) is None


def test_quarantine_ends_when_the_child_answers_or_is_confirmed_dead() -> None:
    assert quarantine_verdict(0.0, True, 1.0, 30.0) is Quarantine.RECOVERED
    assert quarantine_verdict(0.0, False, 1.0, 30.0) is Quarantine.LOST
    assert quarantine_verdict(0.0, None, 1.0, 30.0) is Quarantine.PROBE
    assert quarantine_verdict(0.0, None, 31.0, 30.0) is Quarantine.LOST


def test_progress_counter_moves_with_begin_tick_end() -> None:
    p = Progress()
    with p.working("decode_step", "r-9"):
        p.tick(3)
        snap = p.snapshot()
        assert (snap.phase, snap.work) == ("decode_step", "r-9")
    assert p.snapshot().counter == 5 and p.snapshot().phase is None

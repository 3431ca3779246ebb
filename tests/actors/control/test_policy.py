"""The goodput controller's decisions, as pure functions: each rule acts when it must, and
not when it must not (a moment's imbalance, the fastest engine, no restart left)."""

from __future__ import annotations

import pytest

from erlay.actors.config.control import CallControl, EngineControl, HedgeControl
from erlay.actors.control.policy import (
    EngineState,
    adaptive_deadline,
    aimd,
    engine_actions,
    hedge_after,
    may_hedge,
    percentile,
    pick_engine,
)

K = EngineControl(min_samples=3, slow_ticks=3, max_failures=3, restart_after_s=100.0,
                  intensity_headroom=1)


def fleet(**rates: list[float]) -> dict[str, EngineState]:
    return {path: EngineState(rates=list(r)) for path, r in rates.items()}


def kinds(actions: list) -> list[tuple[str, str]]:
    return [(a.kind, a.target) for a in actions]


def test_a_slow_engine_is_routed_away_only_after_slow_ticks_judgements_in_a_row() -> None:
    engines = fleet(e0=[100.0] * 4, e1=[20.0] * 4)
    assert engine_actions(engines, 0.0, K, restart_headroom=5) == []
    assert engine_actions(engines, 1.0, K, restart_headroom=5) == []
    third = engine_actions(engines, 2.0, K, restart_headroom=5)
    assert kinds(third) == [("route_away", "e1")]
    assert "0.20 of its peers' 100.0" in third[0].reason


def test_a_moment_of_imbalance_resets_the_count() -> None:
    engines = fleet(e0=[100.0] * 4, e1=[20.0] * 4)
    engine_actions(engines, 0.0, K, restart_headroom=5)
    engine_actions(engines, 1.0, K, restart_headroom=5)
    engines["e1"].rates = [90.0] * 4   # caught up
    assert engine_actions(engines, 2.0, K, restart_headroom=5) == []
    assert engines["e1"].slow_ticks == 0


def test_an_engine_within_slow_ratio_of_its_peers_is_left_alone() -> None:
    engines = fleet(e0=[100.0] * 4, e1=[55.0] * 4)
    for t in range(5):
        assert engine_actions(engines, float(t), K, restart_headroom=5) == []


def test_too_few_samples_decide_nothing() -> None:
    engines = fleet(e0=[100.0] * 4, e1=[1.0, 1.0])
    for t in range(5):
        assert engine_actions(engines, float(t), K, restart_headroom=5) == []


def test_the_fastest_engine_is_never_routed_away() -> None:
    # Two engines, each "slow" against the other cannot both be: only the slower goes.
    engines = fleet(e0=[10.0] * 4, e1=[30.0] * 4)
    one = K.model_copy(update={"slow_ticks": 1})
    assert kinds(engine_actions(engines, 0.0, one, restart_headroom=5)) == [("route_away", "e0")]


def test_a_routed_away_engine_gets_its_trial_after_retry_s() -> None:
    engines = fleet(e0=[100.0] * 4, e1=[20.0] * 4)
    engines["e1"].avoided_since, engines["e1"].retry_s = 0.0, 10.0
    engines["e1"].slow_since = 0.0
    assert engine_actions(engines, 9.0, K, restart_headroom=5) == []
    assert kinds(engine_actions(engines, 10.0, K, restart_headroom=5)) == [("trial", "e1")]


def test_a_trial_fails_at_once_and_passes_at_recover_ratio() -> None:
    engines = fleet(e0=[100.0] * 4, e1=[20.0] * 4)
    engines["e1"].on_trial = True
    assert kinds(engine_actions(engines, 0.0, K, restart_headroom=5)) == [("route_away", "e1")]
    engines["e1"].rates = [85.0] * 4
    assert kinds(engine_actions(engines, 1.0, K, restart_headroom=5)) == [("healthy", "e1")]


def test_an_engine_slow_through_every_trial_is_restarted_within_the_intensity() -> None:
    engines = fleet(e0=[100.0] * 4, e1=[20.0] * 4)
    engines["e1"].avoided_since, engines["e1"].slow_since = 90.0, 0.0
    engines["e1"].retry_s = 60.0
    assert kinds(engine_actions(engines, 100.0, K, restart_headroom=2)) == [("restart", "e1")]
    # Headroom 1 is what intensity_headroom leaves to real faults: no restart.
    assert engine_actions(engines, 100.0, K, restart_headroom=1) == []


def test_repeated_stream_failures_restart_a_live_engine_once() -> None:
    engines = fleet(e0=[100.0] * 4, e1=[100.0] * 4)
    engines["e1"].failures = [1.0, 2.0, 3.0]
    actions = engine_actions(engines, 4.0, K, restart_headroom=3)
    assert kinds(actions) == [("restart", "e1")]
    assert "3 stream failures" in actions[0].reason
    engines["e1"].restarting = True   # while it restarts, nothing more is decided on it
    assert engine_actions(engines, 5.0, K, restart_headroom=3) == []


def test_failures_outside_the_window_do_not_count() -> None:
    engines = fleet(e0=[100.0] * 4, e1=[100.0] * 4)
    engines["e1"].failures = [1.0, 2.0, 3.0]
    assert engine_actions(engines, 3.0 + K.failure_window_s + 1.5, K, restart_headroom=3) == []


def test_pick_engine_prefers_the_least_loaded_serving_engine() -> None:
    assert pick_engine({"e0": 3, "e1": 1, "e2": 0}, frozenset({"e2"})) == "e1"
    assert pick_engine({"e0": 3, "e1": 1}, frozenset()) == "e1"
    assert pick_engine({"e0": 3, "e1": 1}, frozenset({"e0", "e1"})) == "e1"


def test_percentile_interpolates() -> None:
    assert percentile([1.0], 0.99) == 1.0
    assert percentile([0.0, 10.0], 0.9) == pytest.approx(9.0)
    assert percentile([], 0.5) is None


def test_hedging_waits_for_samples_then_follows_the_tail() -> None:
    k = HedgeControl(min_samples=4, percentile=0.5, factor=2.0, floor_s=0.1)
    assert hedge_after([1.0] * 3, k) is None
    assert hedge_after([1.0, 1.0, 3.0, 3.0], k) == pytest.approx(4.0)
    assert hedge_after([0.01] * 4, k) == pytest.approx(0.1)   # the floor


def test_may_hedge_only_in_the_tail_and_within_budget() -> None:
    k = HedgeControl(tail_fraction=0.25, max_per_step=2)
    assert may_hedge(16, 64, 0, k)
    assert not may_hedge(17, 64, 0, k)
    assert not may_hedge(0, 64, 0, k)
    assert not may_hedge(1, 64, 2, k)
    assert may_hedge(1, 2, 0, k)   # a tiny step still has a tail of one


def test_the_adaptive_deadline_stays_between_floor_and_configured() -> None:
    k = CallControl(min_samples=5, deadline_percentile=0.9, deadline_multiplier=3.0,
                    deadline_floor_s=0.5)
    assert adaptive_deadline([0.1] * 4, k, 5.0) == 5.0            # too few calls
    assert adaptive_deadline([0.1] * 10, k, 5.0) == 0.5           # floor
    assert adaptive_deadline([0.4] * 10, k, 5.0) == pytest.approx(1.2)
    assert adaptive_deadline([4.0] * 10, k, 5.0) == 5.0           # never above configured


def test_aimd_halves_on_a_timeout_and_grows_one_per_round() -> None:
    k = CallControl(min_concurrency=2, max_concurrency=8)
    assert aimd(8.0, True, k) == 4.0
    assert aimd(2.0, True, k) == 2.0                              # the floor
    limit = 4.0
    for _ in range(4):
        limit = aimd(limit, False, k)
    assert 4.9 < limit < 5.0                                      # ~ one per round of 4
    assert aimd(8.0, False, k) == 8.0                             # the ceiling


def test_call_control_refuses_min_above_max() -> None:
    with pytest.raises(ValueError, match="min_concurrency"):
        CallControl(min_concurrency=9, max_concurrency=8)

"""A resumed run's summary: wall time across both driver runs plus the outage between them,
and throughput over the RL time actually run.  No Ray: metrics.jsonl is written as a killed
driver and its ``--resume`` leave it (records shaped as a real run's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from erlay.actors.observe.summary import write_summary
from erlay.actors.observe.timing import run_timing, split_segments
from erlay.actors.rundir import RunDir

T0 = 1_796_124_209.175          # the first driver's start (unix)
T1 = T0 + 100.0                 # the resumed driver's start: 76 s after the last record


def rl(step: int, t: float, started: float) -> dict[str, Any]:
    return {"time": t, "phase": "rl", "step": step, "version": step + 2, "reward_mean": 0.5,
            "samples": 64, "gen_tokens": 250, "trained_tokens": 250, "user_errors": 0,
            "judge_failed": 0, "masked_stale": 0, "sandbox_calls": 3 * (step + 1),
            "step_s": 1.0, "restarts": 0, "started_at": started}


def killed_then_resumed() -> list[dict[str, Any]]:
    """Warm start to 20 s, steps 0-3 recorded at 21-24 s, then SIGKILL; resumed at T1,
    steps 4-5 recorded 10 and 11 s into the new driver (its Ray start and restore first)."""
    first = [{"time": 20.0, "phase": "warm_start", "steps": 30, "restarts": 0,
              "started_at": T0},
             {"time": 20.1, "phase": "checkpoint", "step": 0, "restarts": 0, "started_at": T0}]
    first += [rl(s, 21.0 + s, T0) for s in range(4)]
    resumed = [rl(4, 10.0, T1), rl(5, 11.0, T1),
               {"time": 11.2, "phase": "checkpoint", "step": 6, "restarts": 0,
                "started_at": T1}]
    return first + resumed


def test_records_split_where_the_driver_start_changes() -> None:
    records = killed_then_resumed()
    assert [len(s) for s in split_segments(records)] == [6, 3]
    old = [{k: v for k, v in r.items() if k != "started_at"} for r in records]
    assert [len(s) for s in split_segments(old)] == [9]  # before started_at: one segment


def test_wall_time_adds_both_driver_runs_and_the_outage() -> None:
    timing = run_timing(killed_then_resumed(), wall_s=15.0, started_at=T1)
    assert [s.wall_s for s in timing.segments] == [24.0, 15.0]
    assert timing.outages_s == pytest.approx((76.0,))
    assert timing.wall_s == pytest.approx(24.0 + 76.0 + 15.0)
    # Six 1 s step windows: the outage is in none of them.
    assert timing.rl_s == pytest.approx(6.0)
    assert timing.resumed == 1


def test_a_resumed_driver_that_recorded_nothing_is_its_own_segment() -> None:
    records = killed_then_resumed()[:6]  # the resumed driver failed before its first record
    timing = run_timing(records, wall_s=5.0, started_at=T1)
    assert [s.wall_s for s in timing.segments] == [24.0, 5.0]
    assert timing.wall_s == pytest.approx(24.0 + 76.0 + 5.0)


def test_a_run_never_resumed_has_no_outage() -> None:
    records = killed_then_resumed()[:6]
    timing = run_timing(records, wall_s=30.0, started_at=T0 + 0.0004)  # rounded in records
    assert (timing.wall_s, timing.outages_s, timing.resumed) == (30.0, (), 0)


def test_the_resumed_runs_summary_counts_both_runs(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    for record in killed_then_resumed():
        run.append_metrics(record)
    text = write_summary(run, "finished", 15.0, started_at=T1)
    assert "- RL steps: 6\n" in text
    assert "- wall time: 115.0 s (2 driver runs: 24.0 s, 15.0 s; and the outage)\n" in text
    assert "- time lost to the outage: 76.0 s" in text
    assert "- RL time: 6.0 s" in text
    # 384 samples and 1500 tokens over 6 s of RL, not over the resumed driver's 15 s.
    assert "- samples: 384 (64.0/s over the RL time)\n" in text
    assert "- generated tokens: 1500 (250.0 tokens/s over the RL time)\n" in text
    assert "- sandbox calls: 30\n" in text  # 12 in the first run, 18 in the resumed one


def test_a_fresh_runs_summary_has_no_outage(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    for record in killed_then_resumed()[:6]:
        run.append_metrics(record)
    text = write_summary(run, "finished", 30.0, started_at=T0)
    assert "- wall time: 30.0 s\n" in text and "outage" not in text
    assert "- samples: 256 (64.0/s over the RL time)\n" in text

"""The throughput figure: smoothed (a rolling mean over the faint raw rate), with failures
drawn, and named in the title and legend, only when there were any.  The decision is pure
(:mod:`erlay.actors.observe.figures`); the drawn figure is checked on real matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from erlay.actors.observe import report
from erlay.actors.observe.figures import rolling_mean, throughput_plan, throughput_title
from tests.actors.observe.test_report import GEN, event, make_run, multi_domain_run, rl
from tests.actors.observe.test_report import T0 as START


def test_the_rolling_mean_trails_over_the_window_and_keeps_one_value_per_point() -> None:
    assert rolling_mean([2.0, 4.0, 6.0, 8.0, 10.0], 3) == [2.0, 3.0, 4.0, 6.0, 8.0]
    assert rolling_mean([5.0, 1.0], 1) == [5.0, 1.0]
    assert rolling_mean([], 5) == []
    with pytest.raises(ValueError):
        rolling_mean([1.0], 0)


def test_a_zigzag_is_flattened_by_the_mean_and_kept_faint_beside_it() -> None:
    zigzag = [(float(t), 100.0 if t % 2 else 300.0) for t in range(10)]
    plan = throughput_plan(zigzag, [], window=2)
    assert plan.raw == zigzag
    assert [r for _, r in plan.smooth] == [300.0] + [200.0] * 9
    assert [x for x, _ in plan.smooth] == [x for x, _ in zigzag]


def test_failures_are_drawn_and_named_only_when_there_were_any() -> None:
    points = [(1.0, 10.0), (2.0, 12.0)]
    quiet = throughput_plan(points, [])
    assert quiet.failures == [] and quiet.legend == ["per step", "mean of 5 steps"]
    assert "failure" not in throughput_title(0)
    hit = throughput_plan(points, [1.5, 0.5])
    assert hit.failures == [0.5, 1.5]
    assert hit.legend == ["per step", "mean of 5 steps", "failure"]
    assert throughput_title(2).endswith("; dashed: failures)")
    assert throughput_plan([], [1.0]).legend == []  # nothing recorded: nothing drawn


def drawn(monkeypatch: pytest.MonkeyPatch, run: Path, tmp_path: Path) -> Any:
    """The throughput figure ``erlay report`` draws for ``run``, before it is closed."""
    figures: list[Any] = []
    monkeypatch.setattr(report, "_save", lambda fig, dest: figures.append(fig))
    data = report.load_run(run)
    assert report.plot_throughput(data, report.analyze(data), tmp_path / "t.png") is None
    (fig,) = figures
    return fig


def test_a_run_without_failures_draws_no_failure_line(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    metrics = [{"time": 4.0, "phase": "warm_start", "started_at": START}]
    metrics += [rl(s, t) for s, t in enumerate((5, 6, 8, 9, 11, 12))]
    events = [event(0.5, GEN, "engine-0", "start", "started")]
    fig = drawn(monkeypatch, make_run(tmp_path / "run", metrics, events), tmp_path)
    top = fig.axes[0]
    assert "failure" not in top.get_title()
    assert [t.get_text() for t in top.get_legend().get_texts()] == ["per step",
                                                                     "mean of 5 steps"]
    assert len(top.lines) == 2  # raw and mean, no dashed line


def test_a_run_with_failures_draws_each_and_says_so(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fig = drawn(monkeypatch, multi_domain_run(tmp_path / "run"), tmp_path)
    top = fig.axes[0]
    assert top.get_title().endswith("dashed: failures)")
    assert [t.get_text() for t in top.get_legend().get_texts()][-1] == "failure"
    assert len(top.lines) == 2 + 3  # raw, mean, and the run's three failures
    raw, mean = top.lines[:2]
    assert raw.get_alpha() < 1 and mean.get_alpha() in (None, 1)  # the raw rate is faint

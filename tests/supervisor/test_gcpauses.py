"""short_gc_pauses: the thresholds it sets hold inside, and the ones found come back after,
even when the body raises."""

from __future__ import annotations

import gc

import pytest

from erlay.supervisor.gcpauses import THRESHOLDS, short_gc_pauses


def test_the_thresholds_hold_inside_and_come_back_after() -> None:
    before = gc.get_threshold()
    with short_gc_pauses():
        assert gc.get_threshold() == THRESHOLDS
        assert THRESHOLDS[0] > before[0]   # fewer young collections: fewer promotions
    assert gc.get_threshold() == before


def test_a_body_that_raises_still_gets_the_old_thresholds_back() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), short_gc_pauses((5000, 5, 5)):
        raise RuntimeError("boom")
    assert gc.get_threshold() == before


def test_the_job_runs_under_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Job.run enters short_gc_pauses around the whole run (the driver hosts the loop)."""
    from erlay.actors.job import driver
    seen: list[tuple[int, int, int]] = []

    def fake_run(self: object, progress: bool, on_start: object) -> str:
        seen.append(gc.get_threshold())
        return "ran"
    monkeypatch.setattr(driver.Job, "_run", fake_run)
    assert driver.Job.run(driver.Job.__new__(driver.Job)) == "ran"
    assert seen == [THRESHOLDS]

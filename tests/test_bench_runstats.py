"""bench/runstats.py: the median (min-max) form of every benchmark figure."""

from __future__ import annotations

import pytest

from bench.runstats import spread


def test_spread_is_the_median_min_and_max_rounded() -> None:
    assert spread([0.31, 0.12345, 0.2, 9.0], digits=2) == {
        "median": 0.26, "min": 0.12, "max": 9.0, "runs": 4}


def test_spread_of_no_runs_is_an_error_not_a_zero() -> None:
    with pytest.raises(ValueError, match="no runs"):
        spread([], digits=2)

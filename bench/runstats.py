"""The form every benchmark reports a timed figure in: median, min and max over runs.

A target met by one lucky run is a miss, so a figure never travels without its spread.
The bench scripts import this as ``runstats`` (their own folder is on ``sys.path``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def spread(values: Sequence[float], *, digits: int) -> dict[str, Any]:
    """``{"median", "min", "max", "runs"}`` of ``values`` (non-empty), rounded to ``digits``."""
    if not values:
        raise ValueError("spread of no runs")
    return {"median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits),
            "runs": len(values)}

"""bench/supervision.py's frozen-child figure at its smallest size: one SIGSTOP of a host at
1 s x 3.  The figure comes out in the bench's JSON line with its documented range, and the
planted run (the heartbeat off) fails naming the figure instead of reporting a number.

The run stops the host half a period after a heartbeat answer, so it lands half a period
from either end of the window (2.5 or 3.5 s of 2-4 s) and a loaded machine's lateness
cannot push it across; the bench's own runs include the worst phase.

The full figure (both kinds, the shipped heartbeat, several runs) takes minutes:
``python bench/supervision.py --only frozen``.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Iterator

import pytest

from bench import supervision

SMALLEST = ["--only", "frozen", "--frozen-runs", "0,1", "--frozen-kinds", "host",
            "--frozen-phase", "0.5"]


@pytest.fixture(autouse=True)
def _erlay_log_levels() -> Iterator[None]:
    """The bench quiets erlay's loggers for its run; the suite's later tests get them back."""
    loggers = [logging.getLogger(name) for name in ("erlay", "erlay.supervisor")]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_frozen_detect_ms_reports_a_figure_within_its_documented_range(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Through bench/supervision_frozen.py's own command line (it adds "--only frozen"), so
    # the script is smoke-run here (tests/test_bench_smoke.py lists it).
    frozen = importlib.import_module("supervision_frozen")  # bench/ is on sys.path
    frozen.main(SMALLEST[2:])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    figure = result["frozen_detect_ms"]["host_1sx3"]
    assert {"median", "min", "max", "runs", "p99", "floor_ms", "bound_ms", "p99_over_bound",
            "since_answer_ms", "missed_heartbeats"} <= set(figure)
    assert (figure["runs"], figure["heartbeat_s"], figure["misses"]) == (1, 1.0, 3)
    assert figure["bound_ms"] == 4000.0 and figure["floor_ms"] == 2000.0
    # The bench's own check, restated: it exits 1 on a figure outside its range.
    assert figure["floor_ms"] <= figure["min"] and figure["p99"] <= figure["bound_ms"]


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_the_planted_run_without_a_heartbeat_fails_naming_the_figure(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        supervision.main([*SMALLEST, "--plant-no-liveness"])
    out = capsys.readouterr().out
    assert exited.value.code == 1
    assert "FAILED: frozen_detect_ms host_1sx3: no hang event" in out
    assert '"frozen_detect_ms": {' not in out, "no figure is reported"

"""bench/loop_lag.py at its smallest size: one default run and one with an environment worker
frozen holding the GIL (3 RL steps each, on the session's Ray), whose figures come out in the
JSON line; and the planted run (a driver thread holding the GIL, as environments on the
driver's threads did) fails naming the figure.

The bench's own runs (3 of each, 40 steps, a 20 s freeze) take minutes:
``python bench/loop_lag.py``."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from bench import loop_lag


@pytest.fixture(autouse=True)
def _erlay_log_levels() -> Iterator[None]:
    """The bench quiets erlay's loggers for its run; the suite's later tests get them back."""
    logger = logging.getLogger("erlay")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_the_quick_run_reports_both_figures_with_the_freeze_landed(
        capsys: pytest.CaptureFixture[str]) -> None:
    loop_lag.main(["--quick"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("loop_lag_p99_ms", "loop_lag_p99_ms_frozen_env"):
        assert set(result[key]) == {"median", "min", "max", "runs"} and result[key]["runs"] == 1
    [frozen] = result["runs"]["frozen_env"]
    assert frozen["env_failures"] >= 1 and frozen["ticks"] > 100   # the freeze landed


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_the_planted_driver_freeze_fails_naming_the_figure() -> None:
    with pytest.raises(SystemExit) as exited:
        loop_lag.main(["--quick", "--plant-in-driver"])
    message = str(exited.value.code)
    assert message.startswith("loop_lag_p99_ms_planted_driver_freeze: ")
    assert "ms > 50 ms: the supervision loop stopped" in message


def test_a_stall_of_the_loop_records_every_timer_it_held_up() -> None:
    """A loop blocked for 0.5 s in a 1 s probe: the timers it held up (about 50) are all
    recorded, so the p99 sees the stall.  A probe that recorded only the one late wake-up
    (coordinated omission) would put the stall at 1 sample of about 50 and miss it."""
    import asyncio
    import time

    async def go() -> loop_lag.Probe:
        loop = asyncio.get_running_loop()
        probe = loop_lag.Probe()
        probe.start(loop)
        await asyncio.sleep(0.25)
        time.sleep(0.5)   # the stall: nothing on this loop runs
        await asyncio.sleep(0.25)
        probe._task.cancel()
        return probe
    probe = asyncio.run(go())
    held_up = [lag for lag in probe.lags_ms if lag >= 100]
    assert len(held_up) >= 35, len(held_up)
    assert probe.percentile(0.99) >= 400
    assert probe.fires < len(probe.lags_ms)   # fewer wake-ups than timers due

"""``erlay run --no-progress``: one INFO line per RL step (step, reward, tokens/s, restarts
so far) from the ``erlay.progress`` logger, in place of the bar.  No Ray: the driver's loop
is fed records through its queue by a stand-in tree."""

from __future__ import annotations

import logging
import queue
from types import SimpleNamespace
from typing import Any

import pytest

from erlay.actors.job.driver import Job, step_line


def rl(step: int, **kw: Any) -> dict[str, Any]:
    return {"phase": "rl", "step": step, "reward_mean": 0.25, "gen_tokens": 300, "samples": 8,
            "step_s": 2.0, "restarts": 0, **kw}


def test_the_line_has_step_reward_tokens_per_second_and_restarts() -> None:
    assert step_line(rl(4, tokens_per_s=601.1, restarts=2), 10) == \
        "step 5/10 reward 0.250 tokens/s 601 restarts 2"
    # No rate recorded: the step's tokens over its step_s; no judged sample: no reward.
    assert step_line(rl(0, reward_mean=None), 3) == "step 1/3 reward - tokens/s 150 restarts 0"
    assert step_line(rl(0, step_s=0.0), 3) == "step 1/3 reward 0.250 tokens/s - restarts 0"


class DrainedTree:
    """Alive until the driver has taken every queued record."""

    def __init__(self, records: queue.Queue[dict[str, Any]]) -> None:
        self.records = records

    @property
    def alive(self) -> bool:
        return not self.records.empty()


@pytest.mark.parametrize("progress", [False, True])
def test_without_the_bar_each_rl_step_logs_one_line(
        progress: bool, caplog: pytest.LogCaptureFixture) -> None:
    records: queue.Queue[dict[str, Any]] = queue.Queue()
    for record in ({"phase": "warm_start", "steps": 3}, rl(0), {"phase": "checkpoint"},
                   rl(1, restarts=1, tokens_per_s=90.0)):
        records.put(record)
    job = SimpleNamespace(metrics=records, cfg=SimpleNamespace(
        run=SimpleNamespace(steps=2, stall_timeout_s=60.0)))
    with caplog.at_level(logging.INFO, logger="erlay.progress"):
        assert Job._follow(job, DrainedTree(records), progress) is None  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records if r.name == "erlay.progress"]
    assert lines == ([] if progress else [
        "step 1/2 reward 0.250 tokens/s 150 restarts 0",
        "step 2/2 reward 0.250 tokens/s 90 restarts 1"])

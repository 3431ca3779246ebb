"""Task work: a deadline and a retry budget, on real Ray tasks."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from erlay.supervisor.errors import TaskDeadlineExceeded, TaskFailed
from erlay.supervisor.tasks import TaskPolicy, run_task

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def dies_once(marker: str) -> int:
    if not Path(marker).exists():
        Path(marker).write_text("died")
        os._exit(1)
    return os.getpid()


def raises() -> None:
    raise ValueError("bad input")


def test_task_past_its_deadline_is_retried_then_fails_with_deadline_exceeded() -> None:
    policy = TaskPolicy(deadline_s=0.3, retries=1)
    started = time.monotonic()
    with pytest.raises(TaskDeadlineExceeded, match="all 2 attempt"):
        asyncio.run(run_task(slow, 30, name="t/slow", policy=policy))
    assert time.monotonic() - started < 10


def test_task_whose_worker_dies_is_retried_and_succeeds(tmp_path: Path) -> None:
    marker = str(tmp_path / "marker")
    pid = asyncio.run(run_task(dies_once, marker, name="t/dies-once",
                               policy=TaskPolicy(deadline_s=30, retries=2)))
    assert isinstance(pid, int) and Path(marker).exists()


def test_exception_from_the_function_is_not_retried_by_default() -> None:
    with pytest.raises(TaskFailed, match="ValueError: bad input") as failure:
        asyncio.run(run_task(raises, name="t/raises", policy=TaskPolicy(retries=3)))
    assert failure.value.attempts == 1

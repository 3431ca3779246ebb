"""bench/goodput_control.py at its smallest size (CI's smoke run: one short pair of
slow_engine), and its refusal to report a figure for a run that did not finish or whose
ledger cannot say what was trained twice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import goodput_control as bench
from tests.paths import REPO

pytestmark = pytest.mark.ray


def test_the_smallest_size_prints_a_table_then_one_json_line() -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "goodput_control.py"),
                           "--smoke"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert any(line.startswith("scenario") for line in lines)
    result = json.loads(lines[-1])
    slow = result["scenarios"]["slow_engine"]
    assert result["smoke"] is True and slow["ratio"]["runs"] == 1
    assert slow["on"]["median"] > 0 and slow["off"]["median"] > 0
    assert slow["lost"] == 0 and slow["trained_twice"] == 0
    assert slow["actions_when_off"] == 0   # off means off


def test_a_run_that_did_not_finish_is_no_figure(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def stalled(*args: object, **kwargs: object) -> SimpleNamespace:
        return SimpleNamespace(status="stalled", reason="no progress for 60 s")
    monkeypatch.setattr(bench, "run_once", stalled)
    with pytest.raises(RuntimeError, match="did not finish: stalled"):
        bench.measure("fault_free", 1, tmp_path, smoke=True, say=lambda line: None)


def test_a_run_whose_ledger_cannot_judge_is_no_figure(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def finished(*args: object, **kwargs: object) -> SimpleNamespace:
        return SimpleNamespace(status="finished", reason="", observation=None)
    monkeypatch.setattr(bench, "run_once", finished)
    monkeypatch.setattr(bench, "trained_twice", lambda obs: None)
    with pytest.raises(RuntimeError, match="cannot say what was trained twice"):
        bench.measure("fault_free", 1, tmp_path, smoke=True, say=lambda line: None)

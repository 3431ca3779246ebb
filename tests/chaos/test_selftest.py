"""``erlay chaos selftest``: each invariant passes a clean run and fails its planted
violation, and the selftest itself fails when an invariant stops catching or raises a
false alarm.  No Ray; real journal, ledger, checkpoint and process-watch writers."""

from __future__ import annotations

import subprocess
import sys

import pytest

import erlay.chaos.invariants as invariants
from erlay.chaos.observation import Verdict
from erlay.chaos.selftest import passed, run_selftest


def test_every_invariant_is_planted_and_caught_without_false_alarms() -> None:
    lines: list[str] = []
    result = run_selftest(out=lines.append)
    assert result == {"invariants": len(invariants.INVARIANTS),
                      "planted": len(invariants.INVARIANTS),
                      "caught": len(invariants.INVARIANTS), "false_alarms": 0}, lines
    assert passed(result)
    assert lines[-1].startswith("{") and '"caught": 16' in lines[-1]


def test_an_invariant_that_cannot_fail_fails_the_selftest(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(invariants, "tool_calls_once",
                        lambda obs: Verdict("tool_calls_once", True, "always"))
    result = run_selftest(out=lambda line: None)
    assert result["caught"] == result["planted"] - 1 and not passed(result)


def test_an_invariant_that_fails_a_clean_run_is_a_false_alarm(monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    monkeypatch.setattr(invariants, "steps_in_order",
                        lambda obs: Verdict("steps_in_order", False, "always"))
    result = run_selftest(out=lambda line: None)
    assert result["false_alarms"] == 1 and not passed(result)


def test_the_command_prints_the_json_line_and_exits_0() -> None:
    done = subprocess.run([sys.executable, "-m", "erlay.supervisor.cli", "chaos", "selftest"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == (
        '{"invariants": 16, "planted": 16, "caught": 16, "false_alarms": 0}')

"""``erlay chaos selftest``: each invariant passes a clean run and fails its planted
violation, and the selftest itself fails when an invariant stops catching or raises a
false alarm.  No Ray; real journal, ledger, checkpoint and process-watch writers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import erlay.chaos.invariants as invariants
from erlay.chaos.observation import Verdict
from erlay.chaos.selftest import PLANTS, ROLLOUTS, STEPS, passed, run_selftest, write_run


def test_a_clean_run_gathered_for_real_has_its_facts_from_evidence(tmp_path: Path) -> None:
    """The clean run's end, orphans and injected fault come from what happened: its summary,
    a real process watch, a real SIGKILL of a real child (no hard-coded observation)."""
    run = write_run(tmp_path, "clean")
    obs = run.observe()
    assert obs.status == "finished" and obs.orphans == [] and run.not_injected == []
    assert obs.journal_kinds["tool_call"] == STEPS * ROLLOUTS and obs.checkpoints
    assert [f.kind for f in obs.faults] == ["sigkill"]
    missed = write_run(tmp_path, "missed", "fault_missed")
    assert missed.not_injected and "exited with 0" in missed.not_injected[0]


def test_an_invariant_that_cannot_fail_fails_the_selftest(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(invariants, "tool_calls_once",
                        lambda obs: Verdict("tool_calls_once", True, "always"))
    tools = [p for p, (name, _) in PLANTS.items() if name == "tool_calls_once"]
    result = run_selftest(out=lambda line: None, only=[*tools, "steps_swapped"])
    assert result["caught"] == 1 and result["planted"] == len(tools) + 1
    assert not passed(result)


def test_an_invariant_that_fails_a_clean_run_is_a_false_alarm(monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    monkeypatch.setattr(invariants, "steps_in_order",
                        lambda obs: Verdict("steps_in_order", False, "always"))
    result = run_selftest(out=lambda line: None, only=[])
    assert result["false_alarms"] == 1 and not passed(result)


def test_every_invariant_is_planted_and_caught_by_the_command_without_false_alarms(
) -> None:
    """``erlay chaos selftest`` as a user runs it: one row per plant, then the JSON line;
    exit 0 only when every plant is caught and nothing fails the clean run."""
    done = subprocess.run([sys.executable, "-m", "erlay.supervisor.cli", "chaos", "selftest"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    n = len(invariants.INVARIANTS)
    result = json.loads(lines[-1])
    assert result == {"invariants": n, "covered": n, "planted": len(PLANTS),
                      "caught": len(PLANTS), "false_alarms": 0}, done.stdout
    assert len(PLANTS) >= 20 and passed(result)
    rows = [line.split() for line in lines[1:-1]]
    assert sorted(r[0] for r in rows) == sorted(PLANTS)
    assert all(r[2] == "FAIL" and r[3] == "yes" for r in rows), done.stdout

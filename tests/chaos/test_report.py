"""The chaos report's numbers on small hand-checked runs, and its markdown.  No Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from erlay.chaos.faults import FaultRecord
from erlay.chaos.invariants import RunObservation, Verdict
from erlay.chaos.report import build_report, goodput, percentiles, render_markdown, write_report
from erlay.supervisor.events import EventKind, SupervisorEvent

T0 = 1_000.0


def ev(supervisor: str, child: str | None, kind: EventKind, t: float,
       reason: str = "error: actor process died") -> SupervisorEvent:
    return SupervisorEvent(supervisor, child, kind, reason, 0, t)


def rl(step: int, samples: int = 8, time: float = 0.0) -> dict[str, object]:
    return {"phase": "rl", "step": step, "samples": samples, "reward_mean": 0.5,
            "time": time, "trained_samples": samples, "trained_tokens": 5 * samples}


def test_percentiles_interpolate_between_ranks() -> None:
    p = percentiles([400, 100, 300, 200])
    assert p["n"] == 4
    assert p["p50"] == pytest.approx(250.0)
    assert p["p99"] == pytest.approx(397.0)  # 300 + 0.97 * 100
    assert p["max"] == 400.0


def test_percentiles_of_one_and_of_none() -> None:
    assert percentiles([7.0]) == {"n": 1, "p50": 7.0, "p99": 7.0, "max": 7.0}
    assert percentiles([]) == {"n": 0, "p50": None, "p99": None, "max": None}


def test_goodput_counts_a_refed_step_once() -> None:
    metrics = [rl(0), rl(1), {"phase": "rewind", "from_step": 2, "to_step": 1}, rl(1), rl(2),
               {"phase": "checkpoint", "step": 2}]
    assert goodput(metrics, 4.0) == pytest.approx(30.0)  # 3 steps x 40 tokens / 4 s
    assert goodput(metrics, 0.0) == 0.0


def _chaos_run() -> RunObservation:
    """Two engine kills (recovered after 500 and 250 ms), one ray_kill nobody saw, a
    sandbox attack that training shrugged off, and a learner hang."""
    faults = [
        FaultRecord(0, "sigkill", "erlay/generation/engine-1", "generation", T0, "restart"),
        FaultRecord(1, "sigkill", "erlay/generation/engine-0", "generation", T0 + 10,
                    "restart"),
        FaultRecord(2, "ray_kill", "erlay/judge/host@node-0", "judge", T0 + 20, "restart"),
        FaultRecord(3, "sandbox_attack", "erlay/sandbox/host@node-0", "sandbox", T0 + 25,
                    "absorbed", "fork bomb"),
        FaultRecord(4, "sigstop", "erlay/learner/learner-0", "learner", T0 + 40, "restart"),
    ]
    events = [
        ev("erlay/generation", "engine-1", EventKind.EXIT, T0 + 0.125),
        ev("erlay/generation", "engine-1", EventKind.RESTART, T0 + 0.125),
        ev("erlay/generation", "engine-1", EventKind.START, T0 + 0.5, "started"),
        ev("erlay/generation", "engine-0", EventKind.EXIT, T0 + 10.125),
        ev("erlay/generation", "engine-0", EventKind.RESTART, T0 + 10.125),
        ev("erlay/generation", "engine-0", EventKind.START, T0 + 10.25, "started"),
        ev("erlay/learner", "learner-0", EventKind.HANG, T0 + 45, "hang: train step"),
        ev("erlay/learner", "learner-0", EventKind.EXIT, T0 + 45, "hang: train step"),
        ev("erlay/learner", "learner-0", EventKind.RESTART, T0 + 45, "hang: train step"),
        ev("erlay", "learner", EventKind.RESTART, T0 + 46, "shutdown: intensity"),
        # the learner never comes back up
    ]
    metrics = [rl(0, time=5.0), rl(1, time=20.0), rl(2, time=30.0), rl(2, time=31.0),
               rl(3, time=60.0)]
    return RunObservation(events=events, metrics=metrics, faults=faults, wall_s=8.0,
                          steps_trained=4, started_at=T0 - 10)


VERDICTS = [Verdict("no_rollout_lost", True, "all 32 rollouts consumed"),
            Verdict("faults_detected", False, "#2 ray_kill undetected"),
            Verdict("replay_identical", None, "max_staleness 1 > 0")]


def test_report_counts_detected_and_recovered_faults() -> None:
    report = build_report("mixed", _chaos_run(), VERDICTS)
    by_id = {f["id"]: f for f in report["faults"]}
    assert report["detected"] == {"count": 3, "faults": [0, 1, 4]}
    # 0, 1: engines started again; 3: rl step 3 ended at T0 + 50, after the attack;
    # 4: the learner never started again.
    assert report["recovered"] == {"count": 3, "faults": [0, 1, 3]}
    assert by_id[0]["detected_after_ms"] == pytest.approx(125.0)
    assert by_id[0]["recovery_ms"] == pytest.approx(500.0)
    assert by_id[2]["outcome"] == "undetected" and by_id[2]["recovered"] is False
    assert by_id[3]["recovery_ms"] is None


def test_recovery_time_percentiles_per_fault_kind() -> None:
    recovery = build_report("mixed", _chaos_run(), VERDICTS)["recovery_ms"]
    assert recovery["sigkill"]["n"] == 2
    assert recovery["sigkill"]["p50"] == pytest.approx(375.0)
    assert recovery["sigkill"]["p99"] == pytest.approx(497.5)  # 250 + 0.99 * 250
    assert recovery["sigkill"]["max"] == pytest.approx(500.0)
    assert recovery["ray_kill"]["n"] == 0 and recovery["ray_kill"]["unrecovered"] == 1
    assert recovery["sigstop"]["unrecovered"] == 1
    assert recovery["sandbox_attack"] is None  # absorbed: no restart expected


def test_restarts_grouped_by_domain_and_cause() -> None:
    restarts = build_report("mixed", _chaos_run(), VERDICTS)["restarts"]
    assert restarts["total"] == 4
    # The root restarting the learner domain counts for the learner, not the root.
    assert restarts["by_domain"] == {"generation": 2, "learner": 2}
    assert restarts["by_cause"] == {"error": 2, "hang": 1, "shutdown": 1}
    assert restarts["by_domain_cause"]["learner"] == {"hang": 1, "shutdown": 1}


def test_goodput_ratios_against_baselines() -> None:
    baselines = {"fault_free": {"goodput": 5.0, "wall_s": 6.4},
                 "job_restart": {"goodput": 2.0}, "broken": {"goodput": 0.0}}
    good = build_report("mixed", _chaos_run(), VERDICTS, baselines=baselines)["goodput"]
    # 4 steps x 40 trained tokens over the run's 8 s (no step windows in these records)
    assert good["samples"] == 32 and good["tokens_per_s"] == pytest.approx(20.0)
    assert good["trained_tokens"] == 160
    assert good["not_trained"] == {"user_errors": 0, "judge_failed": 0, "masked_stale": 0,
                                   "filtered": 0}
    assert good["goodput_vs_fault_free"] == pytest.approx(4.0)
    assert good["goodput_vs_job_restart"] == pytest.approx(10.0)
    assert good["goodput_vs_broken"] is None


def test_report_fails_when_any_invariant_fails() -> None:
    assert build_report("mixed", _chaos_run(), VERDICTS)["ok"] is False
    passing = [v for v in VERDICTS if v.ok is not False]
    assert build_report("mixed", _chaos_run(), passing)["ok"] is True


def test_markdown_shows_every_verdict_and_the_tables() -> None:
    report = build_report("mixed", _chaos_run(), VERDICTS,
                          baselines={"fault_free": {"goodput": 5.0}})
    text = render_markdown(report)
    assert text.startswith("# Chaos report: mixed")
    assert "**FAIL** (1 passed, 1 failed, 1 not applicable)" in text
    assert "| no_rollout_lost | PASS | all 32 rollouts consumed |" in text
    assert "| faults_detected | FAIL | #2 ray_kill undetected |" in text
    assert "| replay_identical | N/A |" in text
    assert "| sigkill | 2 | 375 | 498 | 500 | 0 |" in text
    assert "| sandbox_attack | no restart expected |" in text
    assert "| learner | hang | 1 |" in text
    assert "| vs fault free | 4 |" in text


def test_markdown_escapes_pipes_in_details() -> None:
    report = build_report("x", RunObservation(), [Verdict("no_orphans", False, "a | b")])
    assert "a \\| b" in render_markdown(report)
    assert "No fault was injected." in render_markdown(report)


def test_write_report_writes_json_and_markdown(tmp_path: Path) -> None:
    report = build_report("mixed", _chaos_run(), VERDICTS,
                          baselines={"fault_free": {"goodput": 5.0}})
    json_path, md_path = write_report(tmp_path / "run", report)
    assert json_path.name == "chaos-report.json" and md_path.name == "chaos-report.md"
    assert json.loads(json_path.read_text()) == report
    assert md_path.read_text() == render_markdown(report)

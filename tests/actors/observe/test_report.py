"""`erlay report`: a recorded engine-kill run, synthetic crashed runs, and the CLI."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from erlay.actors.observe.report import load_run, write_report
from erlay.supervisor.cli import main
from tests.paths import REPO

ROOT = REPO
RECORDED = ROOT / "tests" / "data" / "run-engine-kill"
T0 = 1_800_000_000.0  # the synthetic runs' job start, unix seconds
FIGURES = ("reward.png", "throughput.png", "restarts.png", "gen_latency.png")


@pytest.fixture
def cli() -> None:
    """``main`` runs in-process (the dispatcher loads the registered commands)."""


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a valid PNG of non-trivial size (fails the test otherwise)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    assert len(data) > 5_000, f"{path} is only {len(data)} bytes"
    return struct.unpack(">II", data[16:24])


def images(report: Path) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report.read_text())


def report_of(run: Path, out: Path) -> str:
    path = write_report(load_run(run), out)
    assert path == out / "report.md"
    for name in images(path):  # every figure the report links is there and valid
        width, height = png_size(out / name)
        assert width >= 400 and height >= 200
    return path.read_text()


def rl(step: int, t: float, **extra: Any) -> dict[str, Any]:
    return {"time": t, "phase": "rl", "step": step, "version": step + 2,
            "reward_mean": 0.1 * step, "samples": 64, "gen_tokens": 256, "step_s": 1.0,
            "restarts": 0, **extra}


def event(t: float, sup: str, child: str | None, context: str, reason: str) -> dict[str, Any]:
    return {"supervisor": sup, "child": child, "context": context, "reason": reason,
            "attempt": 0, "time": T0 + t, "extra": {}}


def make_run(where: Path, metrics: list[dict[str, Any]] | None,
             events: list[dict[str, Any]] | None, summary: bool = True) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.yaml").write_text("run:\n  name: t\n  steps: 6\n")
    if metrics is not None:
        (where / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if events is not None:
        (where / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if summary:
        (where / "summary.md").write_text("# t\n\n- status: **finished**\n")
    return where


GEN, HOST = "erlay/generation", "erlay/sandbox/host@node-0"


def multi_domain_run(where: Path) -> Path:
    """Steps each 1 s, except step 2 (4 s: two engine kills) and step 4 (3 s: a hang)."""
    metrics = [{"time": 4.0, "phase": "warm_start", "started_at": T0}]
    metrics += [rl(s, t) for s, t in enumerate((5, 6, 10, 11, 14, 15))]
    events = [event(0.5, GEN, "engine-0", "start", "started"),
              event(0.5, GEN, "engine-1", "start", "started"),
              event(0.6, HOST, "sandbox-1", "start", "started"),
              event(7, GEN, "engine-0", "exit", "killed"),
              event(8, GEN, "engine-0", "start", "started"),
              event(9, GEN, "engine-1", "exit", "error: RuntimeError: CUDA error"),
              event(12, GEN, "engine-1", "start", "started"),
              event(12, HOST, "sandbox-1", "hang", "tool_call: no progress for 15.0 s"),
              event(12.1, HOST, "sandbox-1", "exit", "hang: tool_call: no progress"),
              event(16, "erlay", None, "shutdown", "shutdown")]
    return make_run(where, metrics, events)


def test_recorded_engine_kill_is_attributed_to_generation(tmp_path: Path) -> None:
    text = report_of(RECORDED, tmp_path)
    # The kill at 31.37 s falls in step 2's window (28.197, 32.784]: 4.59 s against a
    # failure-free median of 0.29 s.  engine-0 started again 4.74 s after its exit.
    assert "**generation 100%** of 1 failure(s)." in text
    assert "| generation | error | 1 | 100.0% | 4.74 s | 0 | 4.29 s | 60.0% |" in text
    assert "| 0 | 31.37 | `erlay/generation/engine-0` | error | 4.74 s | 4.29 s |" in text
    assert "| RL steps | 8 of 8 planned (steps 0–7) |" in text
    assert "| job start (time zero) | chaos-report.json started_at |" in text
    assert "| status | finished (summary.md)" in text
    assert "| time lost to failures | 4.29 s (60.0% of RL wall time) |" in text
    # Recorded before goodput was defined: no trained_tokens, so no goodput is made up.
    assert ("| goodput | — (metrics.jsonl records no trained_tokens: a run from before "
            "goodput was defined) |") in text
    assert "goodput cost" not in text
    assert images(tmp_path / "report.md") == ["reward.png", "throughput.png", "restarts.png"]
    assert "No generation latency was recorded" in text
    assert not (tmp_path / "gen_latency.png").exists()


def test_multi_domain_run_reads_generation_67_sandbox_33(tmp_path: Path) -> None:
    text = report_of(multi_domain_run(tmp_path / "run"), tmp_path / "out")
    assert "**generation 67%, sandbox 33%** of 3 failure(s)." in text
    # Step 2 cost 3 s (4 s window, 1 s median) split over two kills; step 4 cost 2 s.
    assert "| generation | killed | 1 | 33.3% | 1.00 s | 0 | 1.50 s | 13.6% |" in text
    assert "| generation | error | 1 | 33.3% | 3.00 s | 0 | 1.50 s | 13.6% |" in text
    assert "| sandbox | hang | 1 | 33.3% | — | 1 | 2.00 s | 18.2% |" in text
    assert "| generation | 2 | 66.7% | 2.00 s | 0 | 3.00 s | 27.3% |" in text
    assert "| **all** | 3 | 100.0% | 2.00 s | 1 | 5.00 s | 45.5% |" in text
    assert "| 2 | 12.00 | `erlay/sandbox/host@node-0/sandbox-1` | hang | not restarted |" in text
    assert "| job start (time zero) | metrics.jsonl started_at |" in text


def test_a_failed_checkpoint_save_is_named_in_the_overview(tmp_path: Path) -> None:
    reason = ("checkpoint worker made no progress for 8.0 s (checkpoint.deadline_s 8 s; "
              "pid 9 was stopped (T)) and was killed (exit code -9)")
    metrics = [{"time": 4.0, "phase": "warm_start", "started_at": T0}, rl(0, 5.0),
               {"time": 5.5, "phase": "checkpoint_failed", "step": 2, "reason": reason},
               rl(1, 6.0)]
    text = report_of(make_run(tmp_path / "run", metrics, []), tmp_path / "out")
    assert (f"| failed checkpoint saves | 1 (step 2: {reason}); the previous committed "
            "checkpoint stood each time |") in text
    assert "failed checkpoint saves" not in report_of(
        make_run(tmp_path / "clean", [rl(0, 5.0), rl(1, 6.0)], []), tmp_path / "out2")


def test_goodput_is_trained_tokens_over_rl_wall_time_each_step_once(tmp_path: Path) -> None:
    # Four 1 s windows; step 1 was fed again after a rewind, so its second record wins.
    metrics = [rl(0, 5.0, trained_tokens=100, user_errors=1, judge_failed=0, masked_stale=2),
               rl(1, 6.0, trained_tokens=50, user_errors=0, judge_failed=1, masked_stale=0),
               rl(1, 7.0, trained_tokens=60, user_errors=0, judge_failed=2, masked_stale=0),
               rl(2, 8.0, trained_tokens=40, user_errors=0, judge_failed=0, masked_stale=0,
                  goodput=40.0, time_efficiency=0.9, lost_s=0.0)]
    text = report_of(make_run(tmp_path / "run", metrics, []), tmp_path / "out")
    assert "| RL wall time | 4.0 s (the sum of the step windows) |" in text
    assert ("| goodput | 50.0 tokens/s (200 trained tokens / 4.0 s RL wall time) |") in text
    assert ("| samples not trained | 5 (user_errors 1, judge_failed 2, masked_stale 2; "
            "0 of judge_failed of the judge's own cause) |"
            in text)
    assert "| job-reported (last RL step) | time_efficiency=0.9, lost_s=0.0 |" in text
    assert "Goodput is tokens of samples the learner trained on (inside the staleness" in text


def test_an_old_runs_goodput_fraction_is_shown_as_time_efficiency(tmp_path: Path) -> None:
    metrics = [rl(0, 5.0, judge_marked=3, dropped=4, goodput=0.857, lost_s=0.5)]
    text = report_of(make_run(tmp_path / "run", metrics, []), tmp_path / "out")
    assert "| job-reported (last RL step) | time_efficiency=0.857, lost_s=0.5 |" in text
    assert ("| samples not trained | 4 (user_errors 0, judge_failed 3, masked_stale 1; "
            "0 of judge_failed of the judge's own cause) |"
            in text)
    assert "| goodput | — (metrics.jsonl records no trained_tokens" in text


def test_crashed_run_with_a_torn_line_and_no_summary_still_reports(tmp_path: Path) -> None:
    run = shutil.copytree(RECORDED, tmp_path / "run")
    (run / "summary.md").unlink()
    (run / "chaos-report.json").unlink()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"time": 34.2, "phase": "rl", "step": 8, "rew')
    with open(run / "events.jsonl", "a") as f:
        f.write('{"supervisor": "erlay/gen')
    text = report_of(run, tmp_path / "out")
    assert "metrics.jsonl: the last line is torn (its writer died mid-line); skipped." in text
    assert "events.jsonl: the last line is torn (its writer died mid-line); skipped." in text
    assert "| status | unknown: no summary.md (crashed, killed or still running) |" in text
    assert "| RL steps | 8 of 8 planned (steps 0–7) |" in text
    assert "| job start (time zero) | estimated: the first supervisor event" in text
    assert "| generation | error | 1 | 100.0% | 4.74 s | 0 |" in text
    assert images(tmp_path / "out" / "report.md") == ["reward.png", "throughput.png",
                                                      "restarts.png"]


def test_empty_metrics_and_no_events_degrade_to_notes(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", metrics=[], events=None, summary=False)
    text = report_of(run, tmp_path / "out")
    assert "- metrics.jsonl holds no records: no reward, throughput or goodput figures." in text
    assert "- no events.jsonl: failures, recovery times and time lost cannot be" in text
    assert "No supervisor events were read, so there are no failures to attribute." in text
    assert "No RL step recorded a reward_mean: no reward curve." in text
    assert "| RL steps | 0 of 6 planned |" in text
    assert images(tmp_path / "out" / "report.md") == []
    assert not any((tmp_path / "out" / name).exists() for name in FIGURES)


def test_run_ended_before_rl_has_no_rl_steps_note(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", [{"time": 3.0, "phase": "warm_start"}],
                   [event(1, GEN, "engine-0", "start", "started"),
                    event(2, GEN, "engine-0", "exit", "killed")])
    text = report_of(run, tmp_path / "out")
    assert "metrics.jsonl holds no RL step: the run ended before its first one." in text
    assert "| generation | killed | 1 | 100.0% | — | 1 | 0.00 s | — |" in text
    assert "1 failure(s) fell outside every RL step window" in text
    assert images(tmp_path / "out" / "report.md") == ["restarts.png"]


def test_generate_spans_give_the_latency_histogram(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", [rl(0, 5.0), rl(1, 6.0)], [])
    (run / "telemetry").mkdir()
    spans: list[dict[str, Any]] = [
        {"name": "generate", "trace_id": "0" * 32, "span_id": f"{i:016x}", "parent_id": None,
         "start": T0 + i, "end": T0 + i + (i + 1) / 1000, "attributes": {"erlay.turn": 0},
         "links": [], "status": "OK", "pid": 1, "service": "erlay"}
        for i in range(101)]  # 1..101 ms
    spans.append({**spans[0], "name": "restart", "end": T0 + 60})
    (run / "telemetry" / "spans-1.jsonl").write_text(
        "".join(json.dumps(s) + "\n" for s in spans) + '{"name": "gen')
    text = report_of(run, tmp_path / "out")
    assert ("101 generation turns (telemetry spans named `generate`): p50 51.0 ms, "
            "p99 100.0 ms, max 101.0 ms.") in text
    assert "telemetry: 1 unreadable span line(s) skipped." in text
    assert "gen_latency.png" in images(tmp_path / "out" / "report.md")


def test_without_spans_latency_comes_from_metrics_fields(tmp_path: Path) -> None:
    metrics = [rl(s, 5.0 + s, gen_latency_p50_s=0.01 * (s + 1), gen_latency_p99_s=0.05,
                  gen_latency_max_s=0.08 + s / 100) for s in range(3)]
    text = report_of(make_run(tmp_path / "run", metrics, []), tmp_path / "out")
    assert ("No telemetry spans; per-step figures from metrics.jsonl (3 steps): worst p50 "
            "30.0 ms, worst p99 50.0 ms, max 100.0 ms.") in text
    assert "gen_latency.png" in images(tmp_path / "out" / "report.md")


def test_cli_writes_the_report_and_prints_its_path(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], cli: None) -> None:
    run = multi_domain_run(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run.resolve() / "report" / "report.md")
    assert "generation 67%, sandbox 33%" in (run / "report" / "report.md").read_text()


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: p, "is not an erlay run directory (no config.yaml, metrics.jsonl"),
])
def test_cli_refuses_what_is_not_a_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           cli: None, make: Any, message: str) -> None:
    assert main(["report", str(make(tmp_path)), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("erlay: ") and message in err and "Traceback" not in err


def test_cli_names_the_run_dirs_inside_a_parent_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], cli: None) -> None:
    make_run(tmp_path / "arith-20260101-000000", [], [])
    assert main(["report", str(tmp_path)]) == 2
    assert "run directories in it: arith-20260101-000000" in capsys.readouterr().err


def test_erlay_report_subprocess_reads_but_never_writes_the_run_dir(tmp_path: Path) -> None:
    before = sorted((p.name, p.stat().st_mtime_ns) for p in RECORDED.iterdir())
    script = Path(sys.executable).with_name("erlay")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "erlay.supervisor.cli"]
    result = subprocess.run([*command, "report", str(RECORDED), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "report.md")
    assert "| generation | error | 1 | 100.0% | 4.74 s |" in (tmp_path / "report.md").read_text()
    assert sorted((p.name, p.stat().st_mtime_ns) for p in RECORDED.iterdir()) == before

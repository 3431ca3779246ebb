"""bench/storage.py: its report around the trials, its refusal to pass when a resumed run
does not finish or verify, and how it counts the records lost.  Its trial runs for real, at
the smallest size, in tests/actors/job/test_resume.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest


def trial_figures(verified: bool) -> dict[str, Any]:
    return {"url": "s3://b/runs/r", "kill_after_step": 3, "journal_records_lost": 12,
            "metrics_lines_lost": 1, "upload_age_s": 1.0, "steps_retrained": 1,
            "steps_retrained_extra": 0, "fetch_and_resume_s": 5.0, "resumed_ok": True,
            "verified_ok": verified}


def test_the_smallest_size_prints_a_table_then_one_json_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The report around the trials.  The trial itself (a real run on moto's S3 server, its
    driver killed, resumed from the bucket, verified) runs in CI at the smallest size as
    tests/actors/job/test_resume.py::test_a_run_on_s3_resumes_on_a_fresh_machine_after_its_driver_is_killed,
    which also checks the resumed run against an uninterrupted one."""
    from bench import storage as bench
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(bench, "trial", lambda *a: calls.append(a) or trial_figures(True))
    monkeypatch.setattr(sys, "argv", ["storage.py", "--smoke"])
    bench.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("a crash of the head on s3") and len(calls) == 1
    out = json.loads(lines[-1])
    assert out["resumed_ok"] and out["verified_ok"] and out["trials"] == 1
    assert out["journal_records_lost"] == {"median": 12, "min": 12, "max": 12, "runs": 1}
    run_args, every, kill_at = calls[0][2:5]
    assert "run.steps=6" in run_args and every == 5.0 and kill_at == 3


def test_a_trial_whose_resume_fails_fails_the_bench(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Planted as a broken resume would plant it: the trial's run did not verify."""
    from bench import storage as bench

    monkeypatch.setattr(bench, "trial", lambda *a: trial_figures(False))
    monkeypatch.setattr(sys, "argv", ["storage.py", "--smoke"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 1
    assert '"verified_ok": false' in capsys.readouterr().out


def test_the_records_lost_are_the_local_journals_minus_the_buckets(tmp_path: Path) -> None:
    from bench.storage import journal_records
    from erlay.actors.journal.store import Journal
    from erlay.actors.journal.transitions import Transition, TransitionKind

    for name, records in (("head", 10), ("bucket", 7)):
        journal = Journal.open(tmp_path / name)
        for i in range(records):
            journal.record(Transition(TransitionKind.DISPATCHED, f"r00000-{i}", {}))
        journal.close()
    assert journal_records(tmp_path / "head") - journal_records(tmp_path / "bucket") == 3

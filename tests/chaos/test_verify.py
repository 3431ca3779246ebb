"""``erlay verify RUN_DIR``: exit 0 on a clean run, exit 1 naming the invariant on each of
the selftest's plants that a run directory alone can show, exit 2 on a path that is no run;
a run still being written is read, what is past its last write reported.  No Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from erlay.chaos.selftest import PLANTS, write_run
from erlay.chaos.verify import VERIFIED, verify
from erlay.supervisor.cli import main

# The plants whose evidence is in the run directory (the others are a runner's facts: its
# faults, processes, baseline and expected end).
ON_DISK = [p for p, (name, _) in PLANTS.items() if name in VERIFIED]


def erlay_verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "erlay.supervisor.cli", "verify", *args],
                          capture_output=True, text=True, timeout=120)


def test_every_invariant_verify_checks_has_a_plant() -> None:
    assert {PLANTS[p][0] for p in ON_DISK} == set(VERIFIED)


def test_a_clean_run_verifies_with_exit_0_and_a_json_line(tmp_path: Path) -> None:
    run = write_run(tmp_path, "clean")
    done = erlay_verify(str(run.run_dir.path))
    assert done.returncode == 0, done.stdout + done.stderr
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["ok"] is True and line["fail"] == 0 and line["pass"] == len(VERIFIED)
    assert line["na"] == 0 and line["status"] == "finished"


@pytest.mark.parametrize("plant", ON_DISK)
def test_each_plant_fails_verify_naming_its_invariant(plant: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path, plant, plant)
    code = main(["verify", str(run.run_dir.path), "--json"])   # the command, in-process
    out = capsys.readouterr().out
    assert code == 1, out
    result = json.loads(out)
    assert PLANTS[plant][0] in result["failed"], result


def test_a_path_that_is_no_run_dir_exits_2(tmp_path: Path) -> None:
    done = erlay_verify(str(tmp_path))
    assert done.returncode == 2 and "not an erlay run directory" in done.stderr


def test_a_run_being_written_is_read_and_its_torn_tails_reported(tmp_path: Path) -> None:
    """A driver mid-write leaves a partial line in metrics.jsonl and the ledger and a torn
    journal record: reported as notes, never judged, never a failure."""
    run = write_run(tmp_path, "live")
    with open(run.run_dir.metrics, "a") as f:
        f.write('{"phase": "rl", "step": 5, "rew')
    with open(run.run_dir.ledger, "a") as f:
        f.write('{"step": 5, "vers')
    last = sorted((run.run_dir.journal).glob("segment-*.log"))[-1]
    with open(last, "ab") as f:
        f.write(b"\x00\x00\x01\x00\xde\xad")           # a header whose payload never came
    result = verify(run.run_dir.path)
    assert result.ok, [v for v in result.verdicts if v.ok is False]
    notes = " ".join(result.observation.notes)
    assert "metrics.jsonl" in notes and "ledger.jsonl" in notes and "journal" in notes
    assert last.read_bytes().endswith(b"\xde\xad")      # read-only: nothing truncated


def test_a_run_without_a_summary_is_unended_and_still_verifies(tmp_path: Path) -> None:
    run = write_run(tmp_path, "running")
    run.run_dir.summary.unlink()
    result = verify(run.run_dir.path)
    assert result.observation.status == "unended" and result.ok


def test_a_run_verifies_where_its_plug_ins_are_not_installed(tmp_path: Path) -> None:
    """Only the rollout and supervision sections are read: a config naming an environment
    this machine cannot import still verifies."""
    run = write_run(tmp_path, "elsewhere")
    with open(run.run_dir.config, "a") as f:
        f.write("environment: {class: 'not_installed_here.envs:Env'}\n")
    assert verify(run.run_dir.path).ok


def test_an_invalid_section_it_reads_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path, "badcfg")
    with open(run.run_dir.config, "a") as f:
        f.write("supervision: {learner: {intensity: -1}}\n")
    assert main(["verify", str(run.run_dir.path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "supervision" in err and "intensity" in err


def test_a_corrupt_journal_fails_the_invariants_that_need_it_saying_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every snapshot damaged and the early segments gone (retention): recovery cannot
    start anywhere, which is corruption a crash cannot explain.  No traceback: the
    invariants that need the journal fail naming it."""
    run = write_run(tmp_path, "corrupt")
    for snap in run.run_dir.journal.glob("snapshot-*.snap"):
        data = bytearray(snap.read_bytes())
        data[-1] ^= 0xFF
        snap.write_bytes(bytes(data))
    assert main(["verify", str(run.run_dir.path), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    details = {v["name"]: v["detail"] for v in result["invariants"]}
    assert {"exactly_once", "tool_calls_once", "judgements_stable"} <= set(result["failed"])
    assert "journal corrupt" in details["exactly_once"]

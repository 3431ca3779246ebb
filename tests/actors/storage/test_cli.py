"""Bad remote storage settings are one line and exit code 2, before anything starts: a
missing bucket, refused credentials, a URL that holds no run.  Against a real S3 API server
(moto on loopback, IAM authentication on)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from erlay.supervisor.cli import main
from tests.s3server import S3

# A missing dataset would fail preflight: the storage is refused before it, and before Ray.
LATER_FAILURE = "data.train=/nonexistent/train.jsonl"


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err.strip()
    return code, err


def test_a_missing_bucket_is_one_line_and_exit_2_before_anything_starts(
        tmp_path: Path, s3: S3, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["run", "configs/cpu.yaml", "run.storage=s3://no-such-bucket/runs",
                     f"run.staging={tmp_path / 'staging'}", LATER_FAILURE], capsys)
    assert code == 2 and "\n" not in err, err
    assert err.startswith("erlay: s3://no-such-bucket/runs is not writable") and \
        "bucket does not exist" in err, err
    assert not (tmp_path / "staging").exists()


def test_refused_credentials_are_one_line_and_exit_2(
        tmp_path: Path, s3: S3, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    code, err = run(["run", "configs/cpu.yaml", f"run.storage={s3.url('runs')}",
                     f"run.staging={tmp_path / 'staging'}", LATER_FAILURE], capsys)
    assert code == 2 and "\n" not in err, err
    assert "is not writable" in err and "SIGNATURE_DOES_NOT_MATCH" in err, err
    assert not (tmp_path / "staging").exists()


def test_the_good_settings_get_past_storage_to_the_next_check(
        tmp_path: Path, s3: S3, capsys: pytest.CaptureFixture[str]) -> None:
    """The same command with working storage fails later, on the planted dataset: the two
    tests above failed on storage, not on something before it."""
    code, err = run(["run", "configs/cpu.yaml", f"run.storage={s3.url('runs')}",
                     f"run.staging={tmp_path / 'staging'}", LATER_FAILURE], capsys)
    assert code == 2 and "/nonexistent/train.jsonl" in err and "not writable" not in err, err


@pytest.mark.parametrize("command", [["run", "--resume"], ["export"], ["report"], ["verify"]])
def test_a_url_that_holds_no_run_is_one_line_and_exit_2(
        command: list[str], tmp_path: Path, s3: S3,
        capsys: pytest.CaptureFixture[str]) -> None:
    url = s3.url("runs", f"never-was-{os.getpid()}")
    args = [*command, url] + ([str(tmp_path / "out")] if command == ["export"] else [])
    code, err = run(args, capsys)
    assert code == 2 and "\n" not in err, err
    assert "is not an erlay run directory (no config.yaml)" in err, err


def test_a_run_whose_files_did_not_reach_the_store_fails_and_names_its_local_copy(
        tmp_path: Path, s3: S3) -> None:
    """Every step trained, but the bucket went away: the run is not durable where it was
    asked to be, so it fails (exit 1), and says where everything still is."""
    from erlay.actors.config import load_config
    from erlay.actors.job.driver import Job, JobResult
    from erlay.actors.rundir import RunDir
    from erlay.actors.storage.mirror import Mirror, driver_files
    from erlay.actors.storage.remote import open_remote

    cfg = load_config("configs/cpu-builtin.yaml", ["run.upload_timeout_s=2"])
    gone = open_remote(f"s3://deleted-bucket-{os.getpid()}/runs/r1")
    run_dir = RunDir(tmp_path / "r1", gone)
    run_dir.config.write_text("run: {}\n")
    job = Job(cfg, run_dir, journal=False)
    job.mirror = Mirror(run_dir.path, gone, driver_files, interval_s=0.2).start()
    result = job._uploaded(JobResult("finished", "all steps", 1.0, run_dir))
    assert result.status == "failed" and result.offender == "storage"
    assert f"the local copy is {run_dir.path}" in result.reason
    assert "bucket" in result.reason.lower(), result.reason
    # The same run with the bucket there stays finished.
    here = open_remote(s3.url("runs", "r2"))
    ok_dir = RunDir(tmp_path / "r2", here)
    ok_dir.config.write_text("run: {}\n")
    job = Job(cfg, ok_dir, journal=False)
    job.mirror = Mirror(ok_dir.path, here, driver_files, interval_s=0.2).start()
    assert job._uploaded(JobResult("finished", "all steps", 1.0, ok_dir)).status == "finished"
    assert here.exists("config.yaml")

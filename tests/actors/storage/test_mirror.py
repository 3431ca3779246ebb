"""The mirror's order (pure) and its uploads to a real S3 API server (moto on loopback)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from erlay.actors.storage.mirror import (
    FileState,
    Mirror,
    driver_files,
    learner_files,
    plan,
    scan,
)
from erlay.actors.storage.remote import open_remote
from tests.s3server import S3


def state(size: int = 1, mtime: int = 1) -> FileState:
    return FileState(size, mtime)


def test_a_checkpoints_manifest_goes_after_its_files_and_the_journal_in_number_order() -> None:
    local = {"checkpoints/step-00000004/manifest.json": state(),
             "checkpoints/step-00000004/state.pt": state(),
             "journal/snapshot-000002.snap": state(), "journal/segment-000003.log": state(),
             "journal/segment-000002.log": state(), "journal/segment-000010.log": state(),
             "ledger.jsonl": state(), "metrics.jsonl": state()}
    puts = list(plan(local, {}).puts)
    assert puts[0] == "ledger.jsonl"
    journal = [p for p in puts if p.startswith("journal/")]
    assert journal == ["journal/segment-000002.log", "journal/snapshot-000002.snap",
                       "journal/segment-000003.log", "journal/segment-000010.log"]
    assert puts.index("checkpoints/step-00000004/state.pt") < \
        puts.index("checkpoints/step-00000004/manifest.json")


def test_only_what_changed_is_uploaded_and_what_went_is_removed_after() -> None:
    uploaded = {"metrics.jsonl": state(10), "journal/segment-000001.log": state(5)}
    local = {"metrics.jsonl": state(10), "journal/segment-000002.log": state(3)}
    work = plan(local, uploaded)
    assert work.puts == ("journal/segment-000002.log",)
    assert work.removes == ("journal/segment-000001.log",)
    assert not plan(local, dict(local))


def test_a_working_copy_deleted_under_a_live_mirror_removes_nothing_remotely() -> None:
    """Planted the way a careless ``rm -rf`` of the staging directory would plant it: every
    local file gone.  Only compaction and retention remove, and only while their local
    directory is there."""
    uploaded = {"ledger.jsonl": state(), "metrics.jsonl": state(),
                "journal/segment-000001.log": state(),
                "checkpoints/step-00000002/state.pt": state()}
    assert not plan({}, uploaded, present=frozenset())
    assert plan({}, uploaded).removes == ("checkpoints/step-00000002/state.pt",
                                          "journal/segment-000001.log")


def test_a_resaved_or_retired_checkpoint_loses_its_remote_manifest_first() -> None:
    old = {"checkpoints/step-00000002/state.pt": state(7),
           "checkpoints/step-00000002/manifest.json": state(3)}
    resaved = {"checkpoints/step-00000002/state.pt": state(8, 2),
               "checkpoints/step-00000002/manifest.json": state(3, 2)}
    work = plan(resaved, old)
    assert work.unpublish == ("checkpoints/step-00000002/manifest.json",)
    assert work.puts[-1] == "checkpoints/step-00000002/manifest.json"
    retired = plan({}, old)
    assert retired.unpublish == ("checkpoints/step-00000002/manifest.json",)
    assert retired.removes == ("checkpoints/step-00000002/state.pt",)


def test_the_driver_and_the_learner_split_the_run_and_transient_files_stay(
        tmp_path: Path) -> None:
    for rel in ("config.yaml", "ledger.jsonl", "journal/LOCK", "journal/segment-000001.log",
                "journal/x.tmp", "checkpoints/.tmp-step-00000002-ab/state.pt",
                "checkpoints/step-00000002/state.pt", "report/report.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert set(scan(tmp_path, driver_files)) == {"config.yaml", "journal/segment-000001.log",
                                                 "report/report.md"}
    assert set(scan(tmp_path, learner_files)) == {"ledger.jsonl",
                                                  "checkpoints/step-00000002/state.pt"}


def test_a_mirror_uploads_appends_retires_and_a_flush_says_when_all_is_there(
        tmp_path: Path, s3: S3) -> None:
    remote = open_remote(s3.url("mirror-test"))
    local = tmp_path / "run"
    (local / "checkpoints" / "step-00000002").mkdir(parents=True)
    (local / "checkpoints" / "step-00000002" / "state.pt").write_bytes(b"w" * 1000)
    (local / "checkpoints" / "step-00000002" / "manifest.json").write_text(json.dumps({}))
    (local / "ledger.jsonl").write_text('{"step": 0}\n')
    mirror = Mirror(local, remote, learner_files, interval_s=30.0).start()
    assert mirror.flush(30).ok
    assert remote.listing() == {"ledger.jsonl": 12,
                                "checkpoints/step-00000002/state.pt": 1000,
                                "checkpoints/step-00000002/manifest.json": 2}
    # An append is uploaded whole at the next flush; a retired checkpoint goes.
    with open(local / "ledger.jsonl", "a") as f:
        f.write('{"step": 1}\n')
    for name in ("state.pt", "manifest.json"):
        os.remove(local / "checkpoints" / "step-00000002" / name)
    assert mirror.close(30).ok
    assert remote.listing() == {"ledger.jsonl": 24}
    assert remote.read_text("ledger.jsonl").count("\n") == 2
    assert mirror.stats()["files"] == 4 and mirror.stats()["lag_s_max"] is not None


def test_a_new_mirror_takes_what_the_remote_holds_as_uploaded(tmp_path: Path, s3: S3) -> None:
    remote = open_remote(s3.url("seed-test"))
    (tmp_path / "metrics.jsonl").write_text("a\n")
    assert Mirror(tmp_path, remote, driver_files).start().close(30).ok
    again = Mirror(tmp_path, remote, driver_files).start()
    assert again.close(30).ok
    assert again.files_uploaded == 0


def test_a_flush_against_a_store_that_refuses_fails_in_time_with_the_cause(
        tmp_path: Path, s3: S3) -> None:
    (tmp_path / "metrics.jsonl").write_text("a\n")
    missing = open_remote(f"s3://no-such-bucket-{os.getpid()}/run")
    mirror = Mirror(tmp_path, missing, driver_files, interval_s=0.2).start()
    done = mirror.close(3)
    assert not done.ok and "bucket" in (done.error or "").lower(), done


def test_a_new_checkpoint_is_uploaded_at_once_not_at_the_next_tick(
        tmp_path: Path, s3: S3) -> None:
    """A 60 s tick: without the mark, the checkpoint would wait a minute (planted: the same
    mirror without marks leaves it local)."""
    import time

    from erlay.actors.storage.mirror import checkpoint_marks
    for marks, name in ((checkpoint_marks, "marked"), (None, "unmarked")):
        local = tmp_path / name
        local.mkdir()
        remote = open_remote(s3.url("marks-test", name))
        mirror = Mirror(local, remote, learner_files, interval_s=60.0, marks=marks).start()
        time.sleep(0.3)   # the first pass, of nothing
        step = local / "checkpoints" / "step-00000003"
        step.mkdir(parents=True)
        (step / "state.pt").write_bytes(b"w" * 10)
        (step / "manifest.json").write_text("{}")
        # A marked pass starts within 0.5 s; the unmarked mirror is given 2 s to show it
        # would not have uploaded it.
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not remote.exists(
                "checkpoints/step-00000003/manifest.json"):
            time.sleep(0.1)
        assert remote.exists("checkpoints/step-00000003/manifest.json") == (marks is not None)
        mirror.close(10)

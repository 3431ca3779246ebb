"""Which remote checkpoint a run can restore (pure), and a run fetched back from S3 (moto)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from erlay.actors.storage.fetch import fetch_run, journal_reaches, usable_checkpoints
from erlay.actors.storage.remote import StorageError, open_remote
from tests.s3server import S3


def manifest(snapshot: str | None, size: int = 4) -> dict[str, object]:
    return {"files": {"state.pt": {"bytes": size}},
            "extra": {"journal_snapshot": snapshot} if snapshot else {}}


def test_the_journal_reaches_a_snapshot_by_it_a_later_one_or_a_later_segment() -> None:
    assert journal_reaches({"journal/snapshot-000004.snap": 1}, "snapshot-000004.snap")
    assert journal_reaches({"journal/snapshot-000006.snap": 1}, "snapshot-000004.snap")
    assert journal_reaches({"journal/segment-000005.log": 1}, "snapshot-000004.snap")
    assert not journal_reaches({"journal/segment-000004.log": 1,
                                "journal/snapshot-000002.snap": 1}, "snapshot-000004.snap")
    assert not journal_reaches({}, "snapshot-000004.snap")
    assert journal_reaches({}, None)


def test_a_resume_takes_the_newest_checkpoint_the_journal_reaches_and_whole() -> None:
    listing = {"checkpoints/step-00000002/state.pt": 4,
               "checkpoints/step-00000004/state.pt": 4,
               "checkpoints/step-00000006/state.pt": 3,     # torn: the manifest says 4
               "journal/segment-000003.log": 9}
    found = {2: manifest("snapshot-000001.snap"), 4: manifest("snapshot-000003.snap"),
             6: manifest("snapshot-000002.snap")}
    # Step 4's snapshot is not reached (segment 3 is its own, not one after it).
    assert usable_checkpoints(listing, found, with_journal=True) == [2]
    assert usable_checkpoints(listing, found, with_journal=False) == [4, 2]
    listing["journal/segment-000004.log"] = 1
    assert usable_checkpoints(listing, found, with_journal=True) == [4, 2]


def put(remote: object, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        remote.put_bytes(data, rel)  # type: ignore[attr-defined]


def test_fetch_run_brings_the_run_and_the_usable_checkpoint_manifest_intact(
        tmp_path: Path, s3: S3) -> None:
    remote = open_remote(s3.url("fetch-test", "run-1"))
    put(remote, {"config.yaml": b"run: {}\n", "metrics.jsonl": b"{}\n",
                 "journal/segment-000002.log": b"seg",
                 "checkpoints/step-00000002/state.pt": b"abcd",
                 "checkpoints/step-00000002/manifest.json":
                     json.dumps(manifest("snapshot-000001.snap")).encode(),
                 "checkpoints/step-00000004/state.pt": b"abcd",
                 "checkpoints/step-00000004/manifest.json":
                     json.dumps(manifest("snapshot-000009.snap")).encode()})
    got = fetch_run(remote, tmp_path / "copy")
    assert got.checkpoint == 2 and got.skipped_checkpoints == (4,)
    assert sorted(p.relative_to(tmp_path / "copy").as_posix()
                  for p in (tmp_path / "copy").rglob("*") if p.is_file()) == [
        "checkpoints/step-00000002/manifest.json", "checkpoints/step-00000002/state.pt",
        "config.yaml", "journal/segment-000002.log", "metrics.jsonl"]
    newest = fetch_run(remote, tmp_path / "export", checkpoint="newest", journal=False)
    assert newest.checkpoint == 4 and not (tmp_path / "export" / "journal").exists()
    with pytest.raises(StorageError, match="no complete checkpoint of step 3"):
        fetch_run(remote, tmp_path / "step3", checkpoint="newest", step=3)


def test_a_url_that_holds_no_run_is_one_line(tmp_path: Path, s3: S3) -> None:
    with pytest.raises(StorageError, match=r"is not an erlay run directory \(no config.yaml\)"):
        fetch_run(open_remote(s3.url("nothing-here")), tmp_path / "x")


def test_a_resume_retires_the_newer_checkpoints_its_journal_does_not_reach(
        tmp_path: Path, s3: S3) -> None:
    """Left in place, a learner starting on a node without the run's disk would fetch step 4
    (the newest complete one) and train past what the resumed journal knows."""
    from erlay.actors.learner.options import LearnerOptions
    from erlay.actors.learner.uploads import fetch_newer_checkpoint
    from erlay.actors.storage.fetch import retire_checkpoints

    remote = open_remote(s3.url("retire-test", "run-1"))
    files = {"config.yaml": b"run: {}\n", "journal/segment-000002.log": b"seg"}
    for step, snap in ((2, "snapshot-000001.snap"), (4, "snapshot-000009.snap")):
        files[f"checkpoints/step-{step:08d}/state.pt"] = b"abcd"
        files[f"checkpoints/step-{step:08d}/manifest.json"] = json.dumps(manifest(snap)).encode()
    put(remote, files)
    got = fetch_run(remote, tmp_path / "copy")
    node = LearnerOptions(checkpoint_dir=str(tmp_path / "node" / "checkpoints"),
                          remote_url=remote.url)
    assert fetch_newer_checkpoint(node) == 4   # what retiring prevents
    retire_checkpoints(remote, got.skipped_checkpoints)
    assert not any(r.startswith("checkpoints/step-00000004/") for r in remote.listing())
    fresh = LearnerOptions(checkpoint_dir=str(tmp_path / "node2" / "checkpoints"),
                           remote_url=remote.url)
    assert fetch_newer_checkpoint(fresh) == 2
    assert (tmp_path / "node2" / "checkpoints" / "step-00000002" / "state.pt").read_bytes() \
        == b"abcd"

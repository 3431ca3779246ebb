"""The rollout journal: the pure fold, framing and recovery, snapshots and compaction,
fsync policy, and read-only inspection.  No Ray."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from erlay.actors.journal.inspection import (
    RolloutNotFound,
    inspect_rollout,
    inspect_summary,
    list_rollouts,
)
from erlay.actors.journal.state import (
    JournalState,
    RolloutState,
    apply,
    compact,
    state_from_dict,
    state_to_dict,
)
from erlay.actors.journal.store import (
    HEADER,
    FsyncPolicy,
    Journal,
    JournalBusy,
    JournalClosed,
    JournalCorrupt,
    JournalNotFound,
    read_segment,
    segment_name,
    snapshot_name,
)
from erlay.actors.journal.transitions import MemoryTransitions, Transition, TransitionKind
from erlay.supervisor.clock import FakeClock
from tests.conftest import wait_for
from tests.paths import REPO

K = TransitionKind
REPO = REPO


def dispatched(rid: str, step: int = 0) -> Transition:
    return Transition(K.DISPATCHED, rid, {
        "episode": {"prompt": "2+2=", "answer": "4"}, "prompt_ids": [1, 5, 6],
        "seed": 1234, "version": 3, "step": step, "group": 0, "episode_index": 7})


def chunk(rid: str, turn: int, start: int, ids: tuple[int, ...], version: int) -> Transition:
    # Tuples, as the runner passes TokenChunk fields: the journal must fold them as lists.
    return Transition(K.CHUNK, rid, {"turn": turn, "start": start, "token_ids": ids,
                                     "logprobs": tuple(-0.5 for _ in ids), "version": version})


def whole_rollout(rid: str, step: int = 0) -> list[Transition]:
    """Every transition kind, in the order the runner records them."""
    return [
        dispatched(rid, step),
        chunk(rid, 0, 0, (10, 11, 12), 3),
        chunk(rid, 0, 3, (13,), 4),
        Transition(K.TOOL_CALL, rid, {"key": f"{rid}/tool0", "code": "print(2+2)"}),
        Transition(K.TOOL_RESULT, rid, {"key": f"{rid}/tool0",
                                        "result": {"ok": True, "stdout": "4\n"}}),
        Transition(K.OBSERVATION, rid, {"turn": 0, "token_ids": [20, 21]}),
        chunk(rid, 1, 0, (14, 15), 4),
        Transition(K.JUDGED, rid, {"key": f"{rid}/judge",
                                   "judgement": {"reward": 1.0, "ok": True, "reason": "match"}}),
        Transition(K.COMPLETED, rid, {"reward": 1.0, "judged_ok": True, "failure": None,
                                      "turns": 2}),
    ]


def consumed(rid: str, step: int) -> Transition:
    return Transition(K.CONSUMED, rid, {"step": step, "version": step + 4})


def fold(transitions: list[Transition]) -> JournalState:
    """The reference: the pure fold of what was recorded, after a JSON round trip."""
    state = JournalState()
    for t in transitions:
        apply(state, Transition.from_dict(json.loads(json.dumps(t.to_dict()))))
    return state


def many(n_rollouts: int) -> list[Transition]:
    out: list[Transition] = []
    for i in range(n_rollouts):
        out += whole_rollout(f"r{i:04d}", step=i // 4)
        if i % 2 == 0:
            out.append(consumed(f"r{i:04d}", i // 4))
    return out


def write(directory: Path, transitions: list[Transition], **kw: object) -> JournalState:
    kw.setdefault("snapshot_every", None)
    with Journal.open(directory, **kw) as journal:  # type: ignore[arg-type]
        for t in transitions:
            journal.record(t)
        return journal.state


def last_record_span(path: Path) -> tuple[int, int]:
    seg = read_segment(path.read_bytes())
    return seg.records[-1][0], seg.size


# ----------------------------------------------------------------- the pure fold
def test_fold_builds_the_record_from_every_transition_kind() -> None:
    state = fold(whole_rollout("a"))
    record = state.rollout("a")
    assert record is not None
    assert record.dispatched["seed"] == 1234
    assert [c["version"] for c in record.chunks] == [3, 4, 4]
    assert record.chunks[0]["token_ids"] == [10, 11, 12]
    assert record.tool_results == {"a/tool0": {"ok": True, "stdout": "4\n"}}
    assert state.tool_result("a/tool0") == {"ok": True, "stdout": "4\n"}
    assert state.judgement("a/judge") == {"reward": 1.0, "ok": True, "reason": "match"}
    assert record.observations == [{"turn": 0, "token_ids": [20, 21]}]
    assert record.completed is not None and record.completed["reward"] == 1.0
    assert [kind for kind, _ in record.history] == [
        "dispatched", "chunk", "chunk", "tool_call", "tool_result", "observation", "chunk",
        "judged", "completed"]
    assert state.by_state() == {"in_flight": 0, "completed": 1, "consumed": 0}
    assert state.anomalies == {}


def test_fold_moves_a_rollout_through_its_states() -> None:
    steps = whole_rollout("a")
    state = fold(steps[:4])
    assert [r.rollout_id for r in state.in_flight()] == ["a"]
    assert state.rollout("a").pending_tool_calls() == {"a/tool0": "print(2+2)"}  # type: ignore
    apply(state, steps[4])
    assert state.rollout("a").pending_tool_calls() == {}  # type: ignore[union-attr]
    for t in steps[5:]:
        apply(state, t)
    assert [r.rollout_id for r in state.completed_unconsumed()] == ["a"]
    apply(state, consumed("a", 5))
    assert state.rollout_state("a") is RolloutState.CONSUMED
    assert state.consumed == {"a": 5}
    assert state.by_state() == {"in_flight": 0, "completed": 0, "consumed": 1}


def test_fold_counts_transitions_for_unknown_rollouts_as_anomalies() -> None:
    state = fold([chunk("ghost", 0, 0, (1,), 1),
                  Transition(K.TOOL_RESULT, "ghost", {"key": "k", "result": 1}),
                  Transition(K.COMPLETED, "ghost", {})])
    assert state.rollouts == {}
    assert state.anomaly_count == 3
    assert state.applied == 3


def test_fold_keeps_the_first_completion_result_and_consuming_step() -> None:
    state = fold([*whole_rollout("a"),
                  Transition(K.COMPLETED, "a", {"reward": 0.0}),
                  Transition(K.TOOL_RESULT, "a", {"key": "a/tool0", "result": "other"}),
                  consumed("a", 2), consumed("a", 3), consumed("a", 2),
                  dispatched("a")])
    record = state.rollout("a")
    assert record is not None and record.completed is not None
    assert record.completed["reward"] == 1.0
    assert record.tool_results["a/tool0"] == {"ok": True, "stdout": "4\n"}
    assert state.consumed == {"a": 2}
    assert state.consumed_again == {"a": [3, 2]}   # every later consumption, kept
    assert state.anomalies == {"completed: already completed": 1,
                               "tool_result: after completion": 1,
                               "tool_result: key already has a different one": 1,
                               "consumed: already consumed by another step": 1,
                               "dispatched: rollout already dispatched": 1}


def test_the_fold_names_a_tool_call_made_again_and_counts_every_kind() -> None:
    again = Transition(K.TOOL_CALL, "a", {"key": "a/tool0", "code": "2+2"})
    same = Transition(K.TOOL_RESULT, "a", {"key": "a/tool0", "result": {"ok": True,
                                                                         "stdout": "4\n"}})
    state = fold([*whole_rollout("a"), again, same])
    assert state.anomalies["tool_call: called again after its result was journaled"] == 1
    assert state.anomalies["tool_result: key already has the same one"] == 1
    assert state.kinds["tool_call"] == 2 and state.kinds["dispatched"] == 1
    assert sum(state.kinds.values()) == state.applied


def test_what_the_state_keeps_for_good_survives_a_snapshot_image() -> None:
    state = fold([*whole_rollout("a"), consumed("a", 2), consumed("a", 2)])
    image = json.loads(json.dumps(state_to_dict(state)))
    again = state_from_dict(image)
    assert (again.consumed_again, again.kinds) == ({"a": [2]}, state.kinds)
    del image["consumed_again"], image["kinds"]    # a snapshot written before they were kept
    older = state_from_dict(image)
    assert (older.consumed_again, older.kinds, older.complete) == ({}, {}, False)
    assert again.complete


def test_consumption_of_an_unknown_rollout_is_still_recorded() -> None:
    state = fold([consumed("lost", 4)])
    assert state.consumed == {"lost": 4}
    assert state.rollout_state("lost") is RolloutState.CONSUMED
    assert state.anomaly_count == 1


def test_compact_drops_consumed_records_but_keeps_their_ids_and_steps() -> None:
    state = fold([*whole_rollout("a"), *whole_rollout("b"), consumed("a", 1),
                  dispatched("c")])
    assert compact(state) == 1
    assert set(state.rollouts) == {"b", "c"}
    assert state.consumed == {"a": 1}
    assert state.by_state() == {"in_flight": 1, "completed": 1, "consumed": 1}


def test_compact_keeps_rollouts_consumed_since_the_retained_step() -> None:
    state = fold([*whole_rollout("a", 1), consumed("a", 1),
                  *whole_rollout("b", 2), consumed("b", 2),
                  *whole_rollout("c", 3), consumed("c", 3)])
    assert compact(state, keep_from_step=2) == 1
    assert set(state.rollouts) == {"b", "c"}  # a restore to step 2 must feed these again
    assert state.consumed == {"a": 1, "b": 2, "c": 3}


def test_journal_retains_from_the_committed_step_across_snapshots(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "j", snapshot_every=None) as journal:
        for t in [*whole_rollout("a", 0), consumed("a", 0), *whole_rollout("b", 1),
                  consumed("b", 1)]:
            journal.record(t)
        journal.retain_from_step(1)
        journal.retain_from_step(0)  # never moves back
        journal.snapshot()
        assert set(journal.state.rollouts) == {"b"}
    with Journal.open(tmp_path / "j", read_only=True) as reopened:
        assert set(reopened.state.rollouts) == {"b"}


def test_turn_output_joins_chunks_and_skips_a_resent_prefix() -> None:
    state = fold([dispatched("a"), chunk("a", 0, 0, (1, 2), 1), chunk("a", 0, 1, (2, 3), 2),
                  chunk("a", 1, 0, (9,), 2), chunk("a", 0, 5, (7,), 2)])
    record = state.rollout("a")
    assert record is not None
    tokens, logprobs, versions = record.turn_output(0)
    assert tokens == [1, 2, 3]           # the chunk at 5 lies past a gap and is not joined
    assert versions == [1, 1, 2]
    assert len(logprobs) == 3


def test_state_image_survives_a_json_round_trip() -> None:
    state = fold([*many(5), chunk("ghost", 0, 0, (1,), 1)])
    image = json.loads(json.dumps(state_to_dict(state)))
    assert state_from_dict(image) == state


# ------------------------------------------------------------- journal round trip
def test_every_transition_kind_round_trips_through_a_reopen(tmp_path: Path) -> None:
    transitions = [*whole_rollout("a"), consumed("a", 0), *whole_rollout("b"),
                   dispatched("c"), chunk("c", 0, 0, (1,), 5)]
    live = write(tmp_path, transitions)
    assert live == fold(transitions)
    with Journal.open(tmp_path) as journal:
        assert journal.state == live
        assert journal.recovery.records_replayed == len(transitions)
        assert journal.recovery.clean


def test_records_append_after_a_reopen(tmp_path: Path) -> None:
    first, second = whole_rollout("a"), whole_rollout("b")
    write(tmp_path, first)
    write(tmp_path, second)
    with Journal.open(tmp_path, read_only=True) as journal:
        assert journal.state == fold(first + second)


def test_close_is_idempotent_and_later_records_are_refused(tmp_path: Path) -> None:
    journal = Journal.open(tmp_path)
    journal.record(dispatched("a"))
    journal.close()
    journal.close()
    with pytest.raises(JournalClosed):
        journal.record(dispatched("b"))


def test_unserializable_data_raises_and_writes_nothing(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as journal:
        journal.record(dispatched("a"))
        with pytest.raises(TypeError):
            journal.record(Transition(K.JUDGED, "a", {"key": "k", "judgement": object()}))
        journal.record(Transition(K.COMPLETED, "a", {}))
    with Journal.open(tmp_path) as journal:
        assert journal.state == fold([dispatched("a"), Transition(K.COMPLETED, "a", {})])


def test_a_second_writer_is_refused(tmp_path: Path) -> None:
    with Journal.open(tmp_path), pytest.raises(JournalBusy):
        Journal.open(tmp_path)


def test_concurrent_records_from_threads_all_land_in_order(tmp_path: Path) -> None:
    with Journal.open(tmp_path, snapshot_every=None) as journal:
        for i in range(4):
            journal.record(dispatched(f"t{i}"))

        def worker(i: int) -> None:
            for j in range(200):
                journal.record(chunk(f"t{i}", 0, j, (j,), 1))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        live = journal.state
    with Journal.open(tmp_path) as journal:
        assert journal.state == live
        for i in range(4):
            record = journal.state.rollout(f"t{i}")
            assert record is not None and record.turn_output(0)[0] == list(range(200))


def test_records_survive_sigkill_without_close(tmp_path: Path) -> None:
    script = (
        "import os, signal, sys\n"
        "from erlay.actors.journal.store import Journal, FsyncPolicy\n"
        "from erlay.actors.journal.transitions import Transition, TransitionKind as K\n"
        "j = Journal.open(sys.argv[1], fsync=FsyncPolicy(mode='never'))\n"
        "for i in range(50):\n"
        "    j.record(Transition(K.DISPATCHED, f'r{i}', {'seed': i}))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO,
                          capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    with Journal.open(tmp_path) as journal:  # the lock died with the process
        assert journal.state.by_state()["in_flight"] == 50
        assert journal.recovery.clean


# --------------------------------------------------------------- torn tails
def test_truncating_the_last_record_at_every_offset_recovers_the_records_before_it(
        tmp_path: Path) -> None:
    transitions = whole_rollout("a")
    write(tmp_path / "orig", transitions)
    start, size = last_record_span(tmp_path / "orig" / segment_name(1))
    expected = fold(transitions[:-1])
    for cut in range(start, size):
        work = tmp_path / f"cut{cut}"
        shutil.copytree(tmp_path / "orig", work)
        segment = work / segment_name(1)
        os.truncate(segment, cut)
        with Journal.open(work) as journal:
            assert journal.state == expected, cut
            report = journal.recovery
            assert report.truncated_bytes == cut - start
            assert report.truncated_segment == (segment_name(1) if cut > start else None)
            assert report.records_replayed == len(transitions) - 1
        assert segment.stat().st_size == start
        shutil.rmtree(work)


def test_a_flipped_byte_in_the_last_payload_is_detected_truncated_and_reported(
        tmp_path: Path) -> None:
    transitions = whole_rollout("a")
    write(tmp_path, transitions)
    segment = tmp_path / segment_name(1)
    start, size = last_record_span(segment)
    data = bytearray(segment.read_bytes())
    data[start + HEADER.size + 5] ^= 0x01
    segment.write_bytes(bytes(data))
    with Journal.open(tmp_path) as journal:
        assert journal.state == fold(transitions[:-1])
        assert journal.recovery.reason == "crc mismatch"
        assert journal.recovery.truncated_bytes == size - start
        assert journal.recovery.truncated_offset == start
        assert "truncated torn tail" in journal.recovery.describe()
        journal.record(transitions[-1])          # appends cleanly after the cut
    with Journal.open(tmp_path) as journal:
        assert journal.state == fold(transitions)
        assert journal.recovery.clean


def test_a_valid_crc_over_undecodable_json_is_truncated_not_misread(tmp_path: Path) -> None:
    write(tmp_path, [dispatched("a")])
    segment = tmp_path / segment_name(1)
    payload = b'{"seq":2,"kind":"no-such-kind","rollout_id":"a","data":{}}'
    with open(segment, "ab") as f:
        f.write(HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
    with Journal.open(tmp_path) as journal:
        assert journal.state == fold([dispatched("a")])
        assert (journal.recovery.reason or "").startswith("undecodable record")


def test_corruption_in_a_segment_followed_by_another_raises_journal_corrupt(
        tmp_path: Path) -> None:
    write(tmp_path, many(6), segment_bytes=600)
    segments = sorted(tmp_path.glob("segment-*.log"))
    assert len(segments) >= 3
    victim = segments[1]
    data = bytearray(victim.read_bytes())
    data[HEADER.size + 3] ^= 0xFF
    victim.write_bytes(bytes(data))
    before = victim.read_bytes()
    with pytest.raises(JournalCorrupt) as err:
        Journal.open(tmp_path)
    assert err.value.path == str(victim)
    assert err.value.offset == 0
    assert victim.read_bytes() == before          # nothing was truncated


def test_a_missing_middle_segment_raises_journal_corrupt(tmp_path: Path) -> None:
    write(tmp_path, many(6), segment_bytes=600)
    (tmp_path / segment_name(2)).unlink()
    with pytest.raises(JournalCorrupt, match=re.escape(segment_name(2))):
        Journal.open(tmp_path)


# ------------------------------------------------------ segments and snapshots
def test_segments_roll_at_the_configured_size(tmp_path: Path) -> None:
    transitions = many(6)
    live = write(tmp_path, transitions, segment_bytes=600)
    segments = sorted(tmp_path.glob("segment-*.log"))
    assert len(segments) > 3
    for segment in segments:
        records = read_segment(segment.read_bytes()).records
        biggest = max(len(json.dumps(t.to_dict())) for _, _, t in records) + 64
        assert segment.stat().st_size <= 600 + biggest  # only a lone big record may exceed
    with Journal.open(tmp_path) as journal:
        assert journal.state == live
        assert journal.recovery.segments == tuple(p.name for p in segments)


def test_snapshot_deletes_covered_segments_and_reopen_is_equal(tmp_path: Path) -> None:
    with Journal.open(tmp_path, segment_bytes=600, snapshot_every=None,
                      keep_snapshots=1) as journal:
        for t in many(6):
            journal.record(t)
        position = journal.snapshot()
        for t in whole_rollout("late"):
            journal.record(t)
        live = journal.state
    assert position.snapshot == snapshot_name(position.segment)
    assert position.segment > 3
    assert [p.name for p in tmp_path.glob("snapshot-*")] == [position.snapshot]
    remaining = [int(p.stem.split("-")[1]) for p in tmp_path.glob("segment-*.log")]
    assert remaining and min(remaining) == position.segment + 1
    with Journal.open(tmp_path) as journal:
        assert journal.state == live
        assert journal.recovery.snapshot == position.snapshot
        assert journal.recovery.records_replayed == len(whole_rollout("late"))


def test_consumed_ids_survive_compaction_and_their_records_do_not(tmp_path: Path) -> None:
    transitions = many(8)
    with Journal.open(tmp_path, keep_snapshots=1) as journal:
        for t in transitions:
            journal.record(t)
        journal.snapshot()
    expected = fold(transitions)
    with Journal.open(tmp_path) as journal:
        state = journal.state
        assert state.consumed == expected.consumed and len(state.consumed) == 4
        assert all(state.rollout(rid) is None for rid in state.consumed)
        assert [r.rollout_id for r in state.completed_unconsumed()] == [
            r.rollout_id for r in expected.completed_unconsumed()]
        unconsumed = state.rollout("r0001")
        assert unconsumed is not None and unconsumed == expected.rollout("r0001")


def test_recovery_after_many_records_replays_only_the_snapshot_tail(tmp_path: Path) -> None:
    transitions = many(120)                   # ~1,140 records
    live = write(tmp_path, transitions, segment_bytes=2048, snapshot_every=100)
    assert len(transitions) > 1000
    with Journal.open(tmp_path) as journal:
        assert journal.state == live
        assert journal.recovery.snapshot is not None
        assert journal.recovery.records_replayed < 100
    # Default retention keeps two snapshot generations, never the whole log.
    snapshots = sorted(tmp_path.glob("snapshot-*.snap"))
    assert len(snapshots) == 2
    assert len(list(tmp_path.glob("segment-*.log"))) < 15


def test_explicit_snapshot_twice_without_records_returns_the_same_position(
        tmp_path: Path) -> None:
    with Journal.open(tmp_path, snapshot_every=None) as journal:
        journal.record(dispatched("a"))
        first = journal.snapshot()
        assert journal.snapshot() == first
        journal.record(dispatched("b"))
        assert journal.snapshot().seq == first.seq + 1


def test_a_leftover_snapshot_tmp_is_ignored_and_removed(tmp_path: Path) -> None:
    transitions = many(3)
    live = write(tmp_path, transitions)
    tmp = tmp_path / (snapshot_name(1) + ".tmp")
    tmp.write_bytes(b"\x00\x00\x01half a snapshot")
    with Journal.open(tmp_path, read_only=True) as journal:
        assert journal.state == live
        assert journal.recovery.removed_tmp == (tmp.name,)
    assert tmp.exists()                       # read-only leaves it
    with Journal.open(tmp_path) as journal:
        assert journal.state == live
    assert not tmp.exists()


def test_a_corrupt_snapshot_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    with Journal.open(tmp_path, snapshot_every=None) as journal:   # keep_snapshots=2
        for t in many(4):
            journal.record(t)
        older = journal.snapshot()
        for t in many(8)[len(many(4)):]:
            journal.record(t)
        newer = journal.snapshot()
        journal.record(dispatched("tail"))
        live = journal.state
    (tmp_path / newer.snapshot).write_bytes(b"garbage")
    with Journal.open(tmp_path) as journal:
        assert journal.state == live
        assert journal.recovery.snapshot == older.snapshot
        assert [name for name, _ in journal.recovery.snapshot_fallbacks] == [newer.snapshot]
    assert (tmp_path / (newer.snapshot + ".corrupt")).exists()
    with Journal.open(tmp_path) as journal:   # the writer re-snapshotted: clean again
        assert journal.state == live
        assert journal.recovery.clean


def test_a_corrupt_snapshot_whose_segments_are_gone_raises(tmp_path: Path) -> None:
    with Journal.open(tmp_path, snapshot_every=None, keep_snapshots=1) as journal:
        for t in many(4):
            journal.record(t)
        position = journal.snapshot()
        journal.record(dispatched("tail"))
    data = bytearray((tmp_path / position.snapshot).read_bytes())
    data[-3] ^= 0x10
    (tmp_path / position.snapshot).write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match="crc mismatch"):
        Journal.open(tmp_path)


# ------------------------------------------------------------------- fsync policy
@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd))
    return calls


def test_fsync_always_syncs_every_record(tmp_path: Path, fsyncs: list[int]) -> None:
    with Journal.open(tmp_path, fsync=FsyncPolicy(mode="always"),
                      snapshot_every=None) as journal:
        fsyncs.clear()
        for i in range(10):
            journal.record(dispatched(f"r{i}"))
        assert len(fsyncs) == 10


def test_fsync_batch_syncs_on_its_thread_once_enough_records_wait(
        tmp_path: Path, fsyncs: list[int]) -> None:
    clock = FakeClock()   # never advanced: only the record count can make it due
    policy = FsyncPolicy(every_records=4, every_s=60.0)
    with Journal.open(tmp_path, fsync=policy, clock=clock, snapshot_every=None) as journal:
        fsyncs.clear()
        for i in range(3):
            journal.record(dispatched(f"r{i}"))
        time.sleep(0.2)
        assert fsyncs == [] and journal.unsynced == 3
        journal.record(dispatched("r3"))
        wait_for(lambda: journal.unsynced == 0, timeout=2.0, what="the thread's fsync")
        assert len(fsyncs) == 1


def test_fsync_batch_never_syncs_in_the_recording_thread(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A slow disk holds up the fsync thread, never ``record``."""
    release = threading.Event()
    synced_in: list[str] = []

    def slow_fsync(fd: int) -> None:
        synced_in.append(threading.current_thread().name)
        release.wait(5)
    policy = FsyncPolicy(every_records=2, every_s=0.01)
    journal = Journal.open(tmp_path, fsync=policy, snapshot_every=None)
    monkeypatch.setattr(os, "fsync", slow_fsync)
    started = time.monotonic()
    for i in range(50):
        journal.record(dispatched(f"r{i}"))
        if i == 2:
            wait_for(lambda: synced_in, timeout=2.0, what="an fsync on the thread")
    recorded_in = time.monotonic() - started
    release.set()
    journal.close()
    assert recorded_in < 2.0   # 47 records while an fsync was stuck (5 s) in the thread
    assert synced_in[0].startswith("erlay-journal-fsync")
    assert synced_in[-1] == "MainThread"   # close's own fsync


def test_fsync_batch_syncs_when_the_interval_has_passed(tmp_path: Path,
                                                        fsyncs: list[int]) -> None:
    clock = FakeClock()
    policy = FsyncPolicy(every_records=1000, every_s=0.05)
    with Journal.open(tmp_path, fsync=policy, clock=clock, snapshot_every=None) as journal:
        fsyncs.clear()
        journal.record(dispatched("a"))
        journal.record(dispatched("b"))
        time.sleep(0.2)
        assert fsyncs == []
        clock.advance(0.06)
        wait_for(lambda: journal.unsynced == 0, timeout=2.0, what="the thread's fsync")
        assert len(fsyncs) == 1


def test_fsync_batch_syncs_a_quiet_journal_once_the_interval_has_passed(
        tmp_path: Path, fsyncs: list[int]) -> None:
    clock = FakeClock()
    policy = FsyncPolicy(every_records=1000, every_s=0.05)
    with Journal.open(tmp_path, fsync=policy, clock=clock, snapshot_every=None) as journal:
        fsyncs.clear()
        journal.record(dispatched("a"))  # and nothing after it
        assert fsyncs == []  # the clock has not moved
        clock.advance(0.06)
        wait_for(lambda: fsyncs, timeout=2.0, what="the timer's fsync")
        assert journal.unsynced == 0


def test_an_fsync_failing_on_the_timer_fails_the_journal(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    journal = Journal.open(tmp_path, fsync=FsyncPolicy(every_s=0.05), clock=clock,
                           snapshot_every=None)

    def eio(fd: int) -> None:
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(os, "fsync", eio)
    journal.record(dispatched("a"))
    clock.advance(0.06)

    def failed() -> bool:
        with pytest.raises(JournalClosed, match="Input/output error"):
            journal.flush()  # raises OSError itself until the timer has failed the journal
        return True
    wait_for(failed, timeout=2.0, what="the timer to fail the journal")
    with pytest.raises(JournalClosed):
        journal.record(dispatched("b"))
    journal.close()  # without the fsync that just failed
    assert journal.state.applied == 1


def test_close_stops_the_fsync_timer_and_still_syncs(tmp_path: Path,
                                                     fsyncs: list[int]) -> None:
    before = fsync_timers()
    journal = Journal.open(tmp_path, fsync=FsyncPolicy(every_s=60.0), snapshot_every=None)
    [timer] = fsync_timers() - before
    fsyncs.clear()
    journal.record(dispatched("a"))
    journal.close()
    assert len(fsyncs) == 1 and journal.unsynced == 0
    assert not timer.is_alive()


def test_a_journal_dropped_without_close_ends_its_timer_and_releases_its_lock(
        tmp_path: Path) -> None:
    before = fsync_timers()
    journal = Journal.open(tmp_path, snapshot_every=None)
    [timer] = fsync_timers() - before
    journal.record(dispatched("a"))
    del journal
    gc.collect()
    wait_for(lambda: not timer.is_alive(), timeout=5.0, what="the timer to end")
    with Journal.open(tmp_path, snapshot_every=None) as again:  # no JournalBusy
        assert again.state.applied == 1


def test_only_the_batch_mode_runs_an_fsync_timer(tmp_path: Path) -> None:
    before = fsync_timers()
    for mode in ("always", "never"):
        with Journal.open(tmp_path / mode, fsync=FsyncPolicy(mode=mode)):  # type: ignore[arg-type]
            assert fsync_timers() <= before


def fsync_timers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("erlay-journal-fsync")}


def test_fsync_never_syncs_only_on_close(tmp_path: Path, fsyncs: list[int]) -> None:
    journal = Journal.open(tmp_path, fsync=FsyncPolicy(mode="never"), snapshot_every=None)
    fsyncs.clear()
    for i in range(300):
        journal.record(dispatched(f"r{i}"))
    assert fsyncs == []
    journal.close()
    assert len(fsyncs) == 1


def test_fsync_policy_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        FsyncPolicy(mode="sometimes")  # type: ignore[arg-type]


# -------------------------------------------------------------------- inspection
def make_run(run_dir: Path) -> list[Transition]:
    transitions = [*whole_rollout("r-done"), consumed("r-done", 0), *whole_rollout("r-wait"),
                   dispatched("r-live"), chunk("r-live", 0, 0, (1, 2), 6)]
    write(run_dir / "journal", transitions)
    return transitions


def snapshot_of_files(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in directory.iterdir()}


def test_inspect_summary_counts_rollouts_by_state(tmp_path: Path) -> None:
    make_run(tmp_path)
    text = inspect_summary(tmp_path)
    assert "in_flight 1, completed 1, consumed 1" in text
    assert segment_name(1) in text
    assert "anomalies: none" in text


def test_inspect_rollout_shows_its_history_in_order(tmp_path: Path) -> None:
    make_run(tmp_path)
    lines = inspect_rollout(tmp_path, "r-done").splitlines()
    assert lines[0] == "rollout r-done: consumed"
    kinds = [line.split()[0] for line in lines[1:]]
    assert kinds == ["dispatched", "chunk", "chunk", "tool_call", "tool_result",
                     "observation", "chunk", "judged", "completed", "consumed"]
    assert "version 4" in lines[3]
    assert "by step 0" in lines[-1]
    assert "pending tool calls" not in inspect_rollout(tmp_path, "r-live")


def test_list_rollouts_filters_by_state(tmp_path: Path) -> None:
    make_run(tmp_path)
    text = list_rollouts(tmp_path, "in_flight")
    assert "r-live" in text and "r-wait" not in text
    with pytest.raises(ValueError, match="in_flight"):
        list_rollouts(tmp_path, "finished")


def test_inspection_of_a_run_without_a_journal_is_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(JournalNotFound, match="has no journal"):
        inspect_summary(tmp_path)


def test_inspection_of_an_unknown_rollout_is_a_named_error(tmp_path: Path) -> None:
    make_run(tmp_path)
    with pytest.raises(RolloutNotFound):
        inspect_rollout(tmp_path, "nobody")


def test_read_only_inspection_reports_a_torn_tail_without_modifying_files(
        tmp_path: Path) -> None:
    transitions = make_run(tmp_path)
    segment = tmp_path / "journal" / segment_name(1)
    os.truncate(segment, segment.stat().st_size - 3)
    (tmp_path / "journal" / (snapshot_name(1) + ".tmp")).write_bytes(b"partial")
    before = snapshot_of_files(tmp_path / "journal")
    summary = inspect_summary(tmp_path)
    inspect_rollout(tmp_path, "r-wait")
    list_rollouts(tmp_path, "completed")
    assert "found torn tail" in summary
    assert snapshot_of_files(tmp_path / "journal") == before
    with Journal.open(tmp_path / "journal", read_only=True) as journal:
        assert journal.state == fold(transitions[:-1])
        with pytest.raises(JournalClosed, match="read-only"):
            journal.record(dispatched("x"))


def test_memory_transitions_count_each_kind_as_they_list_it() -> None:
    """``count`` (polled by bench/replay.py's kill schedule while the job runs) agrees with
    ``of``, kind by kind, without walking the transitions."""
    memory = MemoryTransitions()
    for t in whole_rollout("r-1") + whole_rollout("r-2")[:3]:
        memory.record(t)
    for kind in K:
        assert memory.count(kind) == len(memory.of(kind)), kind
    assert memory.count(K.CHUNK) > 0 and memory.count(K.DISPATCHED) == 2


# ----------------------------------------------------------- snapshot encoding
@pytest.mark.parametrize("obj", [
    {}, [], {"a": 1}, list(range(1000)), {f"k{i}": i for i in range(1000)},
    {"state": {"consumed": {f"r{i}": i % 7 for i in range(500)},
               "rollouts": [{"chunks": [[i, i + 1]] * 300, "id": str(i), "x": None,
                             "f": 1.5, "s": "é\"\\\n"} for i in range(300)]}},
    [[list(range(200))] * 200], ({"t": (1, 2)},) * 300, {1: "int keys"},
    [float("nan"), float("inf")] * 100,
])
def test_the_snapshot_encoder_writes_what_json_dumps_writes(obj: Any) -> None:
    from erlay.actors.journal.format import dumps_compact
    assert dumps_compact(obj) == json.dumps(obj, separators=(",", ":"))


def test_the_snapshot_encoder_never_encodes_a_big_container_in_one_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One C call per group of at most ENCODE_GROUP items: between calls another thread (the
    supervision loop's) can take the GIL."""
    from erlay.actors.journal import format as fmt
    largest: list[int] = []
    real = json.dumps

    def counting(obj: Any, **kw: Any) -> str:
        if isinstance(obj, (dict, list)):
            largest.append(len(obj))
        return real(obj, **kw)
    monkeypatch.setattr(fmt.json, "dumps", counting)
    state = {"consumed": {f"r{i}": i for i in range(5000)},
             "rollouts": [{"chunks": list(range(i % 50))} for i in range(3000)]}
    assert json.loads(fmt.dumps_compact({"state": state})) == {"state": state}
    assert largest and max(largest) <= fmt.ENCODE_GROUP

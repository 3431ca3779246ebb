"""The rollout journal's on-disk format, and recovery: reading a journal directory back.

A segment is a sequence of framed records, ``[u32 length][u32 crc32(payload)][payload]``
(big-endian, ``zlib.crc32``), each payload compact JSON ``{"seq", "kind", "rollout_id",
"data"}`` with ``seq`` counting every record since the journal began.  A snapshot is one
framed record ``{"format", "segment", "seq", "state"}``: the folded state through the end of
segment ``segment``, named ``snapshot-<segment>.snap``.  See :mod:`erlay.actors.journal.store` for
the writer, the durability contract and what recovery does with damage; :func:`recover` is the
one place that decides it, and it modifies nothing in read-only mode.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from erlay.actors.journal.state import JournalState, apply, state_from_dict
from erlay.actors.journal.transitions import Transition
from erlay.supervisor.errors import ErlayError

log = logging.getLogger("erlay.journal")

HEADER = struct.Struct(">II")            # payload length, zlib.crc32(payload)
MAX_RECORD_BYTES = 256 * 1024 * 1024     # a larger length can only be a corrupt header
SNAPSHOT_FORMAT = 1
SEGMENT_FILE = re.compile(r"^segment-(\d{6,})\.log$")
SNAPSHOT_FILE = re.compile(r"^snapshot-(\d{6,})\.snap$")


class JournalCorrupt(ErlayError):
    """The journal is damaged somewhere a crash cannot explain; nothing was truncated."""

    def __init__(self, path: Path | str, offset: int | None, reason: str) -> None:
        self.path = str(path)
        self.offset = offset
        self.reason = reason
        where = f"{self.path} at offset {offset}" if offset is not None else self.path
        super().__init__(f"journal corrupt: {where}: {reason}")


class JournalNotFound(ErlayError):
    """There is no journal where one was expected (read-only open, inspection)."""


class JournalBusy(ErlayError):
    """Another writer holds the journal's lock."""


class JournalClosed(ErlayError):
    """The journal cannot take records: closed, opened read-only, or failed on a write."""


@dataclass(frozen=True)
class RecoveryReport:
    """What opening the journal found and did."""

    snapshot: str | None                          # the snapshot recovery started from
    snapshot_fallbacks: tuple[tuple[str, str], ...]  # (corrupt snapshot, why), newest first
    segments: tuple[str, ...]                     # segments replayed, in order
    records_replayed: int                         # records read from segments (not snapshot)
    truncated_bytes: int                          # torn tail cut (or, read-only, found)
    truncated_segment: str | None
    truncated_offset: int | None                  # the last whole record ends here
    reason: str | None                            # why the tail was torn
    removed_tmp: tuple[str, ...]                  # leftover tmp files (ignored)
    read_only: bool

    @property
    def clean(self) -> bool:
        return self.truncated_bytes == 0 and not self.snapshot_fallbacks

    def describe(self) -> str:
        base = self.snapshot or "the start of the log"
        text = (f"recovered from {base} + {len(self.segments)} segment(s), "
                f"{self.records_replayed} record(s) replayed")
        for name, why in self.snapshot_fallbacks:
            text += f"; snapshot {name} unusable ({why})"
        if self.truncated_bytes:
            verb = "found" if self.read_only else "truncated"
            text += (f"; {verb} torn tail of {self.truncated_segment}: {self.truncated_bytes} "
                     f"byte(s) after offset {self.truncated_offset} ({self.reason})")
        if self.removed_tmp:
            text += f"; ignored {', '.join(self.removed_tmp)}"
        return text


# ------------------------------------------------------------------------ format
def segment_name(n: int) -> str:
    return f"segment-{n:06d}.log"


def snapshot_name(n: int) -> str:
    return f"snapshot-{n:06d}.snap"


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def encode_record(seq: int, t: Transition) -> bytes:
    """One record's payload.  Raises TypeError if the data is not JSON-serializable."""
    return json.dumps({"seq": seq, **t.to_dict()}, separators=(",", ":")).encode()


# Containers with more items than this are encoded a group of items at a time.
ENCODE_GROUP = 128


def dumps_compact(obj: Any) -> str:
    """``json.dumps(obj, separators=(",", ":"))``, the same text, made of many short C calls.

    One ``json.dumps`` of a large snapshot is one C call that holds the GIL for all of it
    (100 ms and more on a long job), and the supervision loop shares this process: it would
    fire nothing meanwhile.  Here no C call encodes a list or dict of more than
    :data:`ENCODE_GROUP` items: such a container is encoded that many items at a time, and a
    container holding one is encoded item by item, so another thread can take the GIL
    between calls."""
    out: list[str] = []
    _encode_into(obj, out)
    return "".join(out)


def _heavy(obj: Any) -> bool:
    """Whether ``obj`` is, or holds at any depth, a container of more than ENCODE_GROUP
    items."""
    if isinstance(obj, dict):
        return len(obj) > ENCODE_GROUP or any(_heavy(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return len(obj) > ENCODE_GROUP or any(_heavy(v) for v in obj)
    return False


def _encode_into(obj: Any, out: list[str]) -> None:
    # A dict with a key that is not a str is encoded whole: json converts such keys itself.
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj) and _heavy(obj):
        items = list(obj.items())
        out.append("{")
        for i in range(0, len(items), ENCODE_GROUP):
            group = items[i:i + ENCODE_GROUP]
            if i:
                out.append(",")
            if any(_heavy(v) for _, v in group):
                for j, (k, v) in enumerate(group):
                    out.append(("," if j else "") + json.dumps(k) + ":")
                    _encode_into(v, out)
            else:
                out.append(json.dumps(dict(group), separators=(",", ":"))[1:-1])
        out.append("}")
    elif isinstance(obj, (list, tuple)) and _heavy(obj):
        out.append("[")
        for i in range(0, len(obj), ENCODE_GROUP):
            group = obj[i:i + ENCODE_GROUP]
            if i:
                out.append(",")
            if any(_heavy(v) for v in group):
                for j, v in enumerate(group):
                    if j:
                        out.append(",")
                    _encode_into(v, out)
            else:
                out.append(json.dumps(list(group), separators=(",", ":"))[1:-1])
        out.append("]")
    else:
        out.append(json.dumps(obj, separators=(",", ":")))


@dataclass
class SegmentScan:
    """One segment read back: its records, where the last whole one ends, what stopped it."""

    records: list[tuple[int, int, Transition]]   # (offset, seq, transition)
    good_end: int
    size: int
    bad_reason: str | None


def read_segment(data: bytes) -> SegmentScan:
    """Parse framed records until the end or the first bad one (pure; no I/O)."""
    records: list[tuple[int, int, Transition]] = []
    pos, reason = 0, None
    while pos < len(data):
        if len(data) - pos < HEADER.size:
            reason = "short header"
            break
        length, crc = HEADER.unpack_from(data, pos)
        if length == 0 or length > MAX_RECORD_BYTES:
            reason = f"impossible record length {length}"
            break
        payload = data[pos + HEADER.size:pos + HEADER.size + length]
        if len(payload) < length:
            reason = f"short payload ({len(payload)} of {length} bytes)"
            break
        if zlib.crc32(payload) != crc:
            reason = "crc mismatch"
            break
        try:
            obj = json.loads(payload)
            records.append((pos, int(obj.pop("seq")), Transition.from_dict(obj)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            reason = f"undecodable record ({type(exc).__name__})"
            break
        pos += HEADER.size + length
    return SegmentScan(records, pos, len(data), reason)


def numbered_files(directory: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    out = {}
    for p in directory.iterdir():
        m = pattern.match(p.name)
        if m:
            out[int(m.group(1))] = p
    return out


def list_files(directory: Path | str) -> list[tuple[str, int]]:
    """(name, size) of every file in the journal directory, sorted by name."""
    return sorted((p.name, p.stat().st_size) for p in Path(directory).iterdir() if p.is_file())


def load_snapshot(path: Path) -> tuple[int, JournalState]:
    """(covered segment, state) from a snapshot file; ValueError says why it is unusable."""
    data = path.read_bytes()
    if len(data) < HEADER.size:
        raise ValueError("short header")
    length, crc = HEADER.unpack_from(data)
    payload = data[HEADER.size:]
    if length != len(payload):
        raise ValueError(f"length {length} but {len(payload)} payload bytes")
    if zlib.crc32(payload) != crc:
        raise ValueError("crc mismatch")
    try:
        obj = json.loads(payload)
        if obj["format"] != SNAPSHOT_FORMAT:
            raise ValueError(f"unknown format {obj['format']!r}")
        state = state_from_dict(obj["state"])
        segment, seq = int(obj["segment"]), int(obj["seq"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed ({type(exc).__name__}: {exc})") from exc
    if state.applied != seq:
        raise ValueError(f"state holds {state.applied} records but header says {seq}")
    return segment, state


# ---------------------------------------------------------------------- recovery
@dataclass
class Recovered:
    state: JournalState
    report: RecoveryReport
    base: int                 # the segment the snapshot used covers (0: none)
    last_segment: int         # the segment to continue (0: none after base)
    last_size: int
    corrupt_snapshots: list[Path]


def recover(directory: Path, read_only: bool) -> Recovered:
    segments = numbered_files(directory, SEGMENT_FILE)
    snapshots = numbered_files(directory, SNAPSHOT_FILE)
    tmps = sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))
    fallbacks: list[tuple[str, str]] = []
    corrupt: list[Path] = []
    state, base, base_name = JournalState(), 0, None
    for n in [*sorted(snapshots, reverse=True), 0]:
        if n:
            try:
                covered, loaded = load_snapshot(snapshots[n])
                if covered != n:
                    raise ValueError(f"covers segment {covered}, named for {n}")
            except ValueError as exc:
                log.warning("journal snapshot %s unusable (%s); falling back", snapshots[n], exc)
                fallbacks.append((snapshots[n].name, str(exc)))
                corrupt.append(snapshots[n])
                continue
            state, base, base_name = loaded, n, snapshots[n].name
        tail = sorted(k for k in segments if k > n)
        if tail and tail[0] != n + 1:
            start = f"snapshot {snapshots[n].name}" if n else "the start of the log"
            why = f"needed from {start} but missing"
            if fallbacks:
                why += f" (newer snapshot unusable: {fallbacks[0][1]})"
            raise JournalCorrupt(directory / segment_name(n + 1), None, why)
        break
    tail = sorted(k for k in segments if k > base)
    for prev, k in itertools.pairwise(tail):
        if k != prev + 1:
            raise JournalCorrupt(directory / segment_name(prev + 1), None,
                                 f"missing between {segments[prev].name} and {segments[k].name}")
    replayed, cut, cut_at, cut_name, cut_reason = 0, 0, None, None, None
    last_size = 0
    for k in tail:
        path = segments[k]
        seg = read_segment(path.read_bytes())
        if seg.bad_reason is not None and k != tail[-1]:
            raise JournalCorrupt(path, seg.good_end, f"{seg.bad_reason} in a segment that is "
                                 f"followed by {segments[tail[-1]].name}")
        for offset, seq, t in seg.records:
            if seq != state.applied + 1:
                raise JournalCorrupt(path, offset, f"record seq {seq}, expected "
                                     f"{state.applied + 1}")
            apply(state, t)
            replayed += 1
        if seg.bad_reason is not None:
            cut, cut_at, cut_name, cut_reason = (seg.size - seg.good_end, seg.good_end,
                                                 path.name, seg.bad_reason)
            log.warning("journal %s: torn tail of %d byte(s) after offset %d (%s); %s",
                        path, cut, seg.good_end, seg.bad_reason,
                        "left as is (read-only)" if read_only else "truncating")
            if not read_only:
                with open(path, "r+b") as f:
                    f.truncate(seg.good_end)
                    os.fsync(f.fileno())
        last_size = seg.good_end
    report = RecoveryReport(
        snapshot=base_name, snapshot_fallbacks=tuple(fallbacks),
        segments=tuple(segments[k].name for k in tail), records_replayed=replayed,
        truncated_bytes=cut, truncated_segment=cut_name, truncated_offset=cut_at,
        reason=cut_reason, removed_tmp=tuple(tmps), read_only=read_only)
    return Recovered(state, report, base, tail[-1] if tail else 0, last_size, corrupt)



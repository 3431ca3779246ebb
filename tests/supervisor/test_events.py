"""Every supervisor event has the same fixed fields and reaches every sink."""

from __future__ import annotations

import asyncio
from pathlib import Path

from erlay.supervisor.events import (
    EventKind,
    FanoutSink,
    JsonlSink,
    MemorySink,
    SupervisorEvent,
    read_events,
)
from erlay.supervisor.hosted import InProcessChild
from erlay.supervisor.runtime import Supervisor
from erlay.supervisor.spec import ChildSpec, InProcessStart, SupervisorFlags
from tests.supervisor.children import Echo


class Broken:
    def emit(self, event: SupervisorEvent) -> None:
        raise OSError("disk full")


def test_events_have_fixed_fields_and_land_in_the_jsonl_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    jsonl, memory = JsonlSink(path), MemorySink()

    async def scenario() -> None:
        sup = Supervisor("root", SupervisorFlags(intensity=2),
                         [ChildSpec("e", InProcessStart(Echo))],
                         starters={InProcessStart: InProcessChild.start},
                         sink=FanoutSink([Broken(), jsonl, memory]))
        await sup.boot()
        try:
            await sup.child("e").call("crash")  # type: ignore[union-attr]
        except RuntimeError:
            pass
        while sup.child("e") is None or not memory.of(EventKind.RESTART):
            await asyncio.sleep(0.01)
        await sup.shutdown()

    asyncio.run(scenario())
    jsonl.close()
    events = read_events(path)
    kinds = [e.context for e in events]
    assert kinds[:4] == [EventKind.START, EventKind.EXIT, EventKind.RESTART, EventKind.START]
    for event in events:
        assert event.supervisor == "root" and event.time > 1e9
        assert isinstance(event.attempt, int) and isinstance(event.reason, str)
    exit_event = events[1]
    assert exit_event.child == "e" and "RuntimeError: injected" in exit_event.reason
    assert events[2].attempt == 1


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path)
    sink.emit(SupervisorEvent("root", "a", EventKind.START, "started", 0, 1.7e9))
    sink.close()
    with open(path, "a") as f:
        f.write('{"supervisor": "root", "chi')
    assert [e.child for e in read_events(path)] == ["a"]

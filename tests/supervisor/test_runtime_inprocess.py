"""The shell with in-process children: real asyncio, real clock, no Ray."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from erlay.supervisor.errors import ChildNotRunning, ChildStartError, SupervisorCallError
from erlay.supervisor.events import EventKind, MemorySink
from erlay.supervisor.hosted import InProcessChild
from erlay.supervisor.progress import Progress
from erlay.supervisor.reason import ExitKind
from erlay.supervisor.runtime import Supervisor
from erlay.supervisor.spec import ChildSpec, InProcessStart, SupervisorFlags, SupervisorStart

STARTED: list[str] = []


class Worker:
    """Counts calls; ``boom`` crashes it; ``stall`` holds work without progress."""

    def __init__(self, name: str = "w", fail: bool = False) -> None:
        if fail:
            raise RuntimeError(f"{name} refuses to start")
        self.name = name
        self.n = 0
        self.progress = Progress()
        STARTED.append(name)

    def ping(self) -> int:
        self.n += 1
        return self.n

    def boom(self) -> None:
        raise RuntimeError("boom")

    def stall(self) -> None:
        self.progress.begin("decode_step", work="r-1")


class Finisher:
    async def run(self) -> None:
        await asyncio.sleep(0.01)


def spec(cid: str, **kw: Any) -> ChildSpec:
    args = kw.pop("args", (cid,))
    return ChildSpec(cid, InProcessStart(Worker, args), **kw)


def run(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(coro_fn(), 20))


def make(flags: SupervisorFlags, *specs: ChildSpec, sink: MemorySink | None = None,
         path: str = "root") -> Supervisor:
    return Supervisor(path, flags, specs, starters={InProcessStart: InProcessChild.start},
                      sink=sink or MemorySink())


async def until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def test_crashing_call_restarts_the_child_with_a_new_incarnation() -> None:
    async def scenario() -> None:
        sup = make(SupervisorFlags(intensity=3), spec("a"), spec("b"))
        await sup.boot()
        first = sup.child("a")
        with pytest.raises(RuntimeError, match="boom"):
            await first.call("boom")  # type: ignore[union-attr]
        await until(lambda: sup.child("a") is not first and sup.child("a") is not None)
        assert await sup.child("a").call("ping") == 1  # type: ignore[union-attr]
        rows = {r["id"]: r for r in sup.which_children()}
        assert rows["a"]["incarnation"] == 2 and rows["b"]["incarnation"] == 1
        await sup.shutdown()
    run(scenario)


def test_call_into_a_dead_incarnation_is_refused() -> None:
    async def scenario() -> None:
        sup = make(SupervisorFlags(intensity=0), spec("a"))
        await sup.boot()
        child = sup.child("a")
        with pytest.raises(RuntimeError):
            await child.call("boom")  # type: ignore[union-attr]
        with pytest.raises(ChildNotRunning):
            await child.call("ping")  # type: ignore[union-attr]
        await sup.wait_exit()
    run(scenario)


def test_boot_failure_raises_and_stops_started_children() -> None:
    async def scenario() -> None:
        sup = make(SupervisorFlags(), spec("a"), spec("b", args=("b", True)))
        with pytest.raises(ChildStartError, match="b refuses to start"):
            await sup.boot()
        assert sup.exited and sup.child("a") is None
    run(scenario)


def test_escalation_fails_the_root_and_names_the_leaf() -> None:
    async def scenario() -> None:
        sink = MemorySink()
        inner = ChildSpec("inner", SupervisorStart(SupervisorFlags(intensity=0), (spec("bad"),)),
                          type="supervisor")
        root = make(SupervisorFlags(intensity=0), spec("ok"), inner, sink=sink)
        await root.boot()
        sub = root.child("inner").sup  # type: ignore[union-attr]
        with pytest.raises(RuntimeError):
            await sub.child("bad").call("boom")
        reason = await root.wait_exit()
        assert reason.root_offender == "root/inner/bad"
        assert reason.chain == ("root/inner", "root/inner/bad")
        assert root.child("ok") is None and sub.exited
        assert [e.supervisor for e in sink.of(EventKind.ESCALATION)] == ["root/inner", "root"]
    run(scenario)


def test_hung_child_is_killed_by_its_deadline_and_restarted() -> None:
    async def scenario() -> None:
        sink = MemorySink()
        sup = make(SupervisorFlags(intensity=3),
                   spec("a", deadlines={"decode_step": 0.2}, progress_poll_s=0.05), sink=sink)
        await sup.boot()
        first = sup.child("a")
        await first.call("stall")  # type: ignore[union-attr]
        await until(lambda: sup.child("a") not in (None, first), timeout=3)
        hangs = sink.of(EventKind.HANG)
        assert len(hangs) == 1 and "decode_step" in hangs[0].reason
        exits = sink.of(EventKind.EXIT)
        assert exits and exits[0].reason.startswith("hang")
        await sup.shutdown()
    run(scenario)


def test_idle_child_with_deadlines_is_not_declared_hung() -> None:
    async def scenario() -> None:
        sink = MemorySink()
        sup = make(SupervisorFlags(), spec("a", deadlines={"decode_step": 0.1},
                                           progress_poll_s=0.03), sink=sink)
        await sup.boot()
        await asyncio.sleep(0.4)
        assert sink.of(EventKind.HANG) == [] and sup.child("a") is not None
        await sup.shutdown()
    run(scenario)


def test_main_loop_returning_is_a_normal_exit() -> None:
    async def scenario() -> None:
        sink = MemorySink()
        sup = make(SupervisorFlags(), ChildSpec("f", InProcessStart(Finisher),
                                                restart="transient"), sink=sink)
        await sup.boot()
        await until(lambda: sup.child("f") is None)
        assert sup.which_children()[0]["last_exit"] == "normal"
        assert sink.of(EventKind.RESTART) == []
        await sup.shutdown()
    run(scenario)


def test_dynamic_api_errors_carry_otp_reasons() -> None:
    async def scenario() -> None:
        sup = make(SupervisorFlags(), spec("a"))
        await sup.boot()
        with pytest.raises(SupervisorCallError, match="already_started"):
            await sup.start_child(spec("a"))
        await sup.terminate_child("a")
        assert await sup.restart_child("a") == "a"
        with pytest.raises(SupervisorCallError, match="running"):
            await sup.delete_child("a")
        await sup.shutdown()
        with pytest.raises(SupervisorCallError, match="terminated"):
            await sup.start_child(spec("b"))
    run(scenario)


def test_simple_one_for_one_instances_restart_independently() -> None:
    async def scenario() -> None:
        sup = make(SupervisorFlags("simple_one_for_one", intensity=5),
                   ChildSpec("w", InProcessStart(Worker)))
        await sup.boot()
        ids = [await sup.start_child(args=(f"w{i}",)) for i in range(3)]
        victim = sup.child(ids[1])
        with pytest.raises(RuntimeError):
            await victim.call("boom")  # type: ignore[union-attr]
        await until(lambda: sup.child(ids[1]) not in (None, victim))
        assert sup.child(ids[1]).obj.name == "w1"  # type: ignore[union-attr]
        assert sup.count_children()["active"] == 3
        reason = await sup.shutdown()
        assert reason.kind is ExitKind.SHUTDOWN and sup.count_children()["active"] == 0
    run(scenario)


class _GatedStarter:
    """Starts in-process children; every start after the first waits for ``gate``."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.starts = 0
        self.cancelled = 0

    async def __call__(self, ctx: Any) -> Any:
        self.starts += 1
        if self.starts > 1:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return await InProcessChild.start(ctx)


def _gated(marked: bool) -> tuple[Supervisor, _GatedStarter, MemorySink]:
    from erlay.supervisor.runtime import cancel_safe

    starter = _GatedStarter()
    sink = MemorySink()
    sup = Supervisor("root", SupervisorFlags(intensity=3), (spec("a"),),
                     starters={InProcessStart: cancel_safe(starter) if marked else starter},
                     sink=sink)
    return sup, starter, sink


def test_shutdown_cancels_a_restart_in_progress_of_a_cancel_safe_starter() -> None:
    """An engine restart takes tens of seconds (a hung one, its whole ready timeout): a
    shutdown must not wait for it.  The start is cancelled, reported, and nothing retries."""
    from erlay.supervisor.runtime import CANCELLED_START

    async def scenario() -> None:
        sup, starter, sink = _gated(marked=True)
        await sup.boot()
        with pytest.raises(RuntimeError, match="boom"):
            await sup.child("a").call("boom")  # type: ignore[union-attr]
        await until(lambda: starter.starts == 2)          # the restart waits at its gate
        reason = await asyncio.wait_for(sup.shutdown(), 5)  # the gate never opens
        assert reason.kind is ExitKind.SHUTDOWN
        assert starter.cancelled == 1 and starter.starts == 2
        errors = [e for e in sink.events if e.context is EventKind.START_ERROR]
        assert [e.reason for e in errors] == [CANCELLED_START]
        assert sup.child("a") is None

    run(scenario)


def test_shutdown_waits_for_a_start_whose_starter_is_not_cancel_safe() -> None:
    """OTP's behaviour, kept for starters that could leave something running if cancelled."""
    async def scenario() -> None:
        sup, starter, _ = _gated(marked=False)
        await sup.boot()
        with pytest.raises(RuntimeError, match="boom"):
            await sup.child("a").call("boom")  # type: ignore[union-attr]
        await until(lambda: starter.starts == 2)
        stopping = asyncio.create_task(sup.shutdown())
        await asyncio.sleep(0.3)
        assert not stopping.done() and starter.cancelled == 0
        starter.gate.set()
        assert (await asyncio.wait_for(stopping, 5)).kind is ExitKind.SHUTDOWN
        assert starter.cancelled == 0

    run(scenario)


def test_a_starter_that_turns_its_cancellation_into_an_error_reads_as_cancelled() -> None:
    """The actor starter kills its actor on cancellation and raises ChildStartError naming
    ``CancelledError``: the event says the start was cancelled, not a bare error type."""
    from erlay.supervisor.runtime import CANCELLED_START, cancel_safe

    class Converting(_GatedStarter):
        async def __call__(self, ctx: Any) -> Any:
            try:
                return await super().__call__(ctx)
            except asyncio.CancelledError:
                raise ChildStartError(ctx.path, "CancelledError: ") from None

    async def scenario() -> None:
        starter = Converting()
        sink = MemorySink()
        sup = Supervisor("root", SupervisorFlags(intensity=3), (spec("a"),),
                         starters={InProcessStart: cancel_safe(starter)}, sink=sink)
        await sup.boot()
        with pytest.raises(RuntimeError, match="boom"):
            await sup.child("a").call("boom")  # type: ignore[union-attr]
        await until(lambda: starter.starts == 2)
        await asyncio.wait_for(sup.shutdown(), 5)
        assert starter.cancelled == 1
        assert [e.reason for e in sink.events
                if e.context is EventKind.START_ERROR] == [CANCELLED_START]

    run(scenario)


def test_a_delayed_restart_leaves_the_supervisor_serving_and_a_shutdown_drops_it() -> None:
    """``restart_delay_s``: the restart waits on a timer, not in the supervisor's main task, so
    calls are answered meanwhile; a shutdown cancels the timer, so nothing starts after it."""
    def status(sup: Supervisor, cid: str) -> str:
        return next(r["status"] for r in sup.which_children() if r["id"] == cid)

    async def scenario() -> None:
        sup = make(SupervisorFlags(intensity=5), spec("a", restart_delay_s=1.0), spec("b"))
        await sup.boot()
        loop = asyncio.get_running_loop()
        first = sup.child("a")
        with pytest.raises(RuntimeError, match="boom"):
            await first.call("boom")  # type: ignore[union-attr]
        crashed = loop.time()
        await until(lambda: status(sup, "a") == "restarting")
        with pytest.raises(SupervisorCallError, match="restarting"):
            await sup.restart_child("a")   # answered by the main task, within the delay
        assert loop.time() - crashed < 0.5
        assert await sup.child("b").call("ping") == 1  # type: ignore[union-attr]
        await until(lambda: sup.child("a") not in (None, first))
        assert loop.time() - crashed >= 1.0
        starts = STARTED.count("a")
        with pytest.raises(RuntimeError, match="boom"):
            await sup.child("a").call("boom")  # type: ignore[union-attr]
        await until(lambda: status(sup, "a") == "restarting")
        await asyncio.wait_for(sup.shutdown(), 0.5)
        await asyncio.sleep(1.2)
        assert STARTED.count("a") == starts

    run(scenario)

"""Worker processes: code that may freeze runs one call at a time in a process of its own,
each call under a deadline.  Real processes, real asyncio, no Ray."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import psutil
import pytest

from erlay.supervisor.errors import ChildStartError
from erlay.supervisor.events import EventKind, MemorySink
from erlay.supervisor.procs import ProcessKeeper
from erlay.supervisor.runtime import Supervisor
from erlay.supervisor.spec import ChildSpec, Liveness, SupervisorFlags, WorkerStart
from erlay.supervisor.worker_process import WorkerCall, WorkerPool, WorkerProcess

ECHO = "tests.supervisor.worker_objects:Echo"


def run(coro_fn: Callable[[], Awaitable[Any]], timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro_fn(), timeout))


def worker_spec(cid: str = "w", *, call_timeout_s: float = 1.0, liveness: Liveness | None = None,
                **kwargs: Any) -> ChildSpec:
    return ChildSpec(cid, WorkerStart(ECHO, kwargs=kwargs, call_timeout_s=call_timeout_s,
                                      ready_timeout_s=kwargs.pop("ready", 20.0)
                                      if "ready" in kwargs else 20.0),
                     liveness=liveness)


def make(*specs: ChildSpec, sink: MemorySink | None = None,
         keeper: ProcessKeeper | None = None, intensity: int = 3) -> Supervisor:
    keeper = keeper or ProcessKeeper()
    return Supervisor("host", SupervisorFlags("one_for_one", intensity=intensity, period=10),
                      specs, starters={WorkerStart: partial(WorkerProcess.start, keeper=keeper)},
                      sink=sink or MemorySink())


def worker(sup: Supervisor, cid: str = "w") -> WorkerProcess:
    proc = sup.child(cid)
    assert isinstance(proc, WorkerProcess)
    return proc


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_call_returns_the_method_value_from_another_process() -> None:
    async def go() -> tuple[Any, Any, int]:
        sup = make(worker_spec())
        await sup.boot()
        w = worker(sup)
        got = await w.call("echo", ({"a": [1, 2]},))
        awaited = await w.call("aecho", ("x",))
        pid = (await w.call("pid")).value
        await sup.shutdown()
        return got, awaited, pid
    got, awaited, pid = run(go)
    assert got.ok and got.value == {"a": [1, 2]}
    assert awaited.value == "x"
    assert pid != os.getpid()


@pytest.mark.parametrize("method", ["freeze", "deadlock", "sleep"])
def test_a_call_past_its_deadline_times_out_and_its_process_is_replaced_in_place(
        method: str) -> None:
    """Whatever holds the call (the GIL in C code, a deadlock, a sleep), the call ends at
    its deadline, the process is killed and replaced, and the child does not restart."""
    sink = MemorySink()

    async def go() -> tuple[Any, int, int, Any, int, int]:
        sup = make(worker_spec(call_timeout_s=0.5), sink=sink)
        await sup.boot()
        w = worker(sup)
        before = w.pid
        args = (30.0,) if method == "sleep" else ()
        outcome = await w.call(method, args)
        after = w.pid
        again = await w.call("echo", (7,))
        incarnation = sup.which_children()[0]["incarnation"]
        await sup.shutdown()
        return outcome, before, after, again, incarnation, w.replaced
    outcome, before, after, again, incarnation, replaced = run(go)
    assert outcome.kind == "timeout" and "0.5 s" in outcome.detail
    assert after != before and gone(before)
    assert again.ok and again.value == 7
    assert incarnation == 1 and replaced == 1
    assert [e.context for e in sink.events].count(EventKind.RESTART) == 0
    assert any(e.context is EventKind.REPLACED for e in sink.events)


@pytest.mark.parametrize("method", ["die", "segfault"])
def test_a_process_that_dies_under_a_call_is_reported_died_and_replaced(method: str) -> None:
    async def go() -> tuple[Any, Any]:
        sup = make(worker_spec())
        await sup.boot()
        w = worker(sup)
        outcome = await w.call(method)
        again = await w.call("echo", ("after",))
        await sup.shutdown()
        return outcome, again
    outcome, again = run(go)
    assert outcome.kind == "died"
    assert ("exit code 3" if method == "die" else "SIGSEGV") in outcome.detail
    assert again.value == "after"


@pytest.mark.parametrize("method", ["boom", "unpicklable"])
def test_an_exception_escaping_the_served_object_crashes_the_worker(method: str) -> None:
    """The served object is erlay's own code: a raise is a crash, the supervisor restarts
    the child (a new incarnation), and the call is lost, not blamed on its input."""
    sink = MemorySink()

    async def go() -> tuple[Any, int, Any]:
        sup = make(worker_spec(), sink=sink)
        await sup.boot()
        outcome = await worker(sup).call(method)
        for _ in range(200):
            await asyncio.sleep(0.05)
            rows = sup.which_children()
            if rows[0]["incarnation"] == 2 and sup.child("w") is not None:
                break
        again = await worker(sup).call("echo", (1,))
        await sup.shutdown()
        return outcome, rows[0]["incarnation"], again
    outcome, incarnation, again = run(go)
    assert outcome.kind == "lost" and "crashed" in outcome.detail
    assert incarnation == 2 and again.ok
    exits = [e for e in sink.events if e.context is EventKind.EXIT]
    assert exits and "raised" in exits[0].reason


def test_a_worker_stopped_under_a_call_is_lost_and_restarted_as_hung() -> None:
    """SIGSTOP from outside is not the call's fault: the call is lost (to be tried
    elsewhere) and the child exits as hung."""
    sink = MemorySink()

    async def go() -> Any:
        sup = make(worker_spec(call_timeout_s=0.5), sink=sink)
        await sup.boot()
        w = worker(sup)
        pending = asyncio.ensure_future(w.call("sleep", (0.3,)))
        await asyncio.sleep(0.1)
        os.kill(w.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        outcome = await pending
        for _ in range(100):
            await asyncio.sleep(0.05)
            if sup.which_children()[0]["incarnation"] == 2:
                break
        await sup.shutdown()
        return outcome
    outcome = run(go)
    assert outcome.kind == "lost" and "stopped" in outcome.detail
    exits = [e for e in sink.events if e.context is EventKind.EXIT]
    assert exits and "hang" in exits[0].reason


def test_an_idle_worker_that_is_stopped_misses_its_heartbeat_and_restarts() -> None:
    sink = MemorySink()

    async def go() -> int:
        sup = make(worker_spec(liveness=Liveness(0.2, 2)), sink=sink)
        await sup.boot()
        pid = worker(sup).pid
        os.kill(pid, signal.SIGSTOP)  # type: ignore[arg-type]
        for _ in range(200):
            await asyncio.sleep(0.05)
            if sup.which_children()[0]["incarnation"] == 2 and sup.child("w") is not None:
                break
        incarnation = sup.which_children()[0]["incarnation"]
        await sup.shutdown()
        assert pid is not None and gone(pid)
        return incarnation
    assert run(go) == 2
    assert any(e.context is EventKind.HANG for e in sink.events)


def test_a_worker_process_that_dies_while_idle_exits_and_its_supervisor_restarts_it() -> None:
    async def go() -> int:
        sup = make(worker_spec())
        await sup.boot()
        os.kill(worker(sup).pid, signal.SIGKILL)  # type: ignore[arg-type]
        for _ in range(100):
            await asyncio.sleep(0.05)
            if sup.which_children()[0]["incarnation"] == 2 and sup.child("w") is not None:
                break
        incarnation = sup.which_children()[0]["incarnation"]
        await sup.shutdown()
        return incarnation
    assert run(go) == 2


@pytest.mark.parametrize(("kwargs", "message"), [({"fail": True}, "refuses to start"),
                                                 ({"hang_s": 30.0, "ready": 0.5},
                                                  "not ready within 0.5 s")])
def test_a_constructor_that_raises_or_hangs_is_a_start_failure(kwargs: dict[str, Any],
                                                                 message: str) -> None:
    keeper = ProcessKeeper()

    async def go() -> None:
        sup = make(worker_spec(**kwargs), keeper=keeper)
        await sup.boot()
    with pytest.raises(ChildStartError, match=message):
        run(go)
    assert keeper.groups == {}  # nothing left running


def test_a_frozen_call_costs_its_worker_only_the_pool_keeps_serving() -> None:
    """Two workers: one call freezes its process; the other worker answers calls while it
    is frozen, and a call queued behind the frozen one is not lost."""
    async def go() -> tuple[Any, list[Any], float, float]:
        sup = make(worker_spec("a", call_timeout_s=1.5), worker_spec("b", call_timeout_s=1.5))
        await sup.boot()
        pool = WorkerPool(lambda: [worker(sup, c) for c in ("a", "b") if sup.child(c)])
        loop = asyncio.get_running_loop()
        frozen = asyncio.ensure_future(pool.run(WorkerCall("freeze"), 10.0))
        await asyncio.sleep(0.2)
        started = loop.time()
        others = await asyncio.gather(*(pool.run(WorkerCall("echo", (i,)), 10.0)
                                        for i in range(20)))
        served_in = loop.time() - started
        outcome = await frozen
        await sup.shutdown()
        return outcome, others, served_in, 1.5
    outcome, others, served_in, deadline = run(go)
    assert outcome.kind == "timeout"
    assert [o.value for o in others] == list(range(20))
    assert served_in < deadline  # served while the other worker was still frozen


def test_a_call_waiting_for_a_free_worker_gives_up_after_its_queue_timeout() -> None:
    async def go() -> Any:
        sup = make(worker_spec(call_timeout_s=5.0))
        await sup.boot()
        pool = WorkerPool(lambda: [worker(sup)])
        busy = asyncio.ensure_future(pool.run(WorkerCall("sleep", (1.0,)), 10.0))
        await asyncio.sleep(0.1)
        queued = await pool.run(WorkerCall("echo", (1,)), 0.3)
        await busy
        await sup.shutdown()
        return queued
    queued = run(go)
    assert queued.kind == "lost" and "free within 0.3 s" in queued.detail


def test_a_cancelled_call_leaves_no_late_reply_for_the_next_call() -> None:
    """A caller that gives up mid-call: the process is replaced, so its late answer can
    never be read as the next call's."""
    async def go() -> tuple[Any, int | None, int | None]:
        sup = make(worker_spec(call_timeout_s=5.0))
        await sup.boot()
        w = worker(sup)
        pool = WorkerPool(lambda: [worker(sup)])
        before = w.pid
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pool.run(WorkerCall("sleep", (0.5,)), 5.0), 0.1)
        again = await pool.run(WorkerCall("echo", ("next",)), 10.0)
        after = w.pid
        await sup.shutdown()
        return again, before, after
    again, before, after = run(go)
    assert again.value == "next" and after != before


def test_failpoints_reach_inside_the_worker_process() -> None:
    async def go() -> tuple[Any, Any]:
        sup = make(worker_spec())
        await sup.boot()
        w = worker(sup)
        report = await w.control("arm", "judge.user_code", {"action": "raise"})
        listed = await w.control("list")
        await sup.shutdown()
        return report, listed
    report, listed = run(go)
    assert "judge.user_code" in report["armed"] and "judge.user_code" in listed["armed"]


def test_a_failpoint_armed_while_a_call_runs_reaches_the_process_after_it() -> None:
    """Chaos arms a busy worker too: the control message waits for the call, never skips
    the worker (a counted failpoint would never fire in it otherwise)."""
    async def go() -> tuple[Any, Any]:
        sup = make(worker_spec(call_timeout_s=5.0))
        await sup.boot()
        w = worker(sup)
        busy = asyncio.ensure_future(w.call("sleep", (0.5,)))
        await asyncio.sleep(0.1)
        report = await w.control("arm", "judge.user_code", {"action": "raise", "count": 1})
        done = await busy
        await sup.shutdown()
        return report, done
    report, done = run(go)
    assert done.value == "slept" and report is not None and "judge.user_code" in report["armed"]


def test_stopping_the_supervisor_leaves_no_worker_process() -> None:
    keeper = ProcessKeeper()

    async def go() -> list[int]:
        sup = make(worker_spec("a"), worker_spec("b"), keeper=keeper)
        await sup.boot()
        pids = [worker(sup, c).pid for c in ("a", "b")]
        pending = asyncio.ensure_future(worker(sup, "a").call("freeze"))
        await asyncio.sleep(0.2)
        await sup.shutdown()
        pending.cancel()
        return [p for p in pids if p is not None]
    pids = run(go)
    assert len(pids) == 2 and all(gone(p) for p in pids)


def test_worker_start_validates_its_fields() -> None:
    from erlay.supervisor.errors import InvalidSpec
    with pytest.raises(InvalidSpec, match="module:attr"):
        WorkerStart("no-colon")
    with pytest.raises(InvalidSpec, match="call_timeout_s"):
        WorkerStart(ECHO, call_timeout_s=0)

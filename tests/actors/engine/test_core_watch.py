"""The EngineCore watch: a process's exit runs the callback once, on the loop's next turn."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from types import SimpleNamespace
from typing import Any

from erlay.actors.engine.core_watch import ExitWatch, core_processes


def _spawn_sleeper() -> multiprocessing.process.BaseProcess:
    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,),
                                                        daemon=True)
    proc.start()
    return proc


def _parent_of_a_sleeper(conn: Any) -> None:
    """Fork a grandchild that sleeps on (holding every inherited descriptor, as vLLM's
    CPU workers do), send its pid, and sleep."""
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    conn.send(pid)
    time.sleep(60)


def _watch_until_killed(proc: Any, victim: int) -> tuple[list[float], float]:
    calls: list[float] = []

    async def main() -> float:
        watch = ExitWatch(asyncio.get_running_loop(), [proc],
                          lambda: calls.append(time.monotonic()))
        await asyncio.sleep(0.2)
        assert calls == [] and watch.watching, "fired while the process lives"
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        for _ in range(200):
            if calls:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)   # a level-triggered reader left in place would fire again
        assert not watch.watching
        return killed

    return calls, asyncio.run(main())


def test_a_killed_process_fires_the_callback_once_and_promptly() -> None:
    proc = _spawn_sleeper()
    calls, killed = _watch_until_killed(proc, proc.pid)
    proc.join(5)
    assert len(calls) == 1, f"the callback ran {len(calls)} times"
    # Generous: the point is "the next loop turn", not the 0.5 s poll it replaces.
    assert calls[0] - killed < 2.0


def test_the_process_is_watched_not_its_sentinel_which_its_children_hold_open() -> None:
    """vLLM's CPU workers inherit the EngineCore's sentinel pipe, so the sentinel reads EOF
    only once they exit too; the watch must fire when the EngineCore alone dies."""
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_parent_of_a_sleeper,
                                                       args=(child,), daemon=True)
    proc.start()
    grandchild = parent.recv()
    try:
        calls, _ = _watch_until_killed(proc, proc.pid)
        assert len(calls) == 1, "the watch waited for the process's children"
    finally:
        os.kill(grandchild, signal.SIGKILL)
        proc.join(5)


def test_a_closed_watch_never_fires() -> None:
    proc = _spawn_sleeper()
    calls: list[int] = []

    async def main() -> None:
        watch = ExitWatch(asyncio.get_running_loop(), [proc], lambda: calls.append(1))
        watch.close()
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.sleep(0.3)

    asyncio.run(main())
    proc.join(5)
    assert calls == []


def test_processes_are_read_from_vllms_engine_manager_or_none() -> None:
    procs = [SimpleNamespace(pid=7), SimpleNamespace(pid=9)]
    llm = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(
        engine_manager=SimpleNamespace(processes=procs))))
    assert core_processes(llm) == procs
    # Another vLLM (an external or Ray-managed engine): nothing to watch, no error.
    assert core_processes(SimpleNamespace(engine_core=SimpleNamespace(resources=None))) == []
    assert core_processes(object()) == []


def test_an_engine_core_exit_fails_every_open_stream_and_ends_the_group() -> None:
    """What the watch's callback does in the vLLM engine, without starting vLLM: each open
    request gets EngineFailed, and the group's other processes (vLLM's workers, which
    outlive their EngineCore) are killed at once, not at the supervisor's terminate."""
    from erlay.actors.engine.api import EngineFailed, GenerationRequest
    from erlay.actors.engine.vllm_engine import VllmEngine, _Request

    engine = VllmEngine({"vocab_size": 16, "max_seq_len": 32})
    killed: list[bool] = []
    engine.group = SimpleNamespace(kill_members=lambda: killed.append(True) or [])
    queues = [asyncio.Queue() for _ in range(2)]
    for i, queue in enumerate(queues):
        engine._requests[f"r{i}"] = _Request(GenerationRequest(f"r{i}", (1, 2), 4, seed=0), queue)
    engine._core_exited()
    assert killed == [True]
    assert all(isinstance(q.get_nowait(), EngineFailed) for q in queues)
    assert all(r.done for r in engine._requests.values())
    assert engine._failed.is_set()

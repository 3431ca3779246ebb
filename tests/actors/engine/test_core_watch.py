"""The EngineCore watch: a process's exit runs the callback once, on the loop's next turn."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

from erlay.actors.engine.core_watch import SentinelWatch, core_sentinels


def _spawn_sleeper() -> multiprocessing.process.BaseProcess:
    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,),
                                                        daemon=True)
    proc.start()
    return proc


def test_a_killed_process_fires_the_callback_once_and_promptly() -> None:
    proc = _spawn_sleeper()
    calls: list[float] = []

    async def main() -> float:
        watch = SentinelWatch(asyncio.get_running_loop(), [proc.sentinel],
                              lambda: calls.append(time.monotonic()))
        await asyncio.sleep(0.2)
        assert calls == [] and watch.watching, "fired while the process lives"
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        for _ in range(200):
            if calls:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)   # a level-triggered reader left in place would fire again
        assert not watch.watching
        return killed

    killed = asyncio.run(main())
    proc.join(5)
    assert len(calls) == 1, f"the callback ran {len(calls)} times"
    # Generous: the point is "the next loop turn", not the 0.5 s poll it replaces.
    assert calls[0] - killed < 2.0


def test_a_closed_watch_never_fires() -> None:
    proc = _spawn_sleeper()
    calls: list[int] = []

    async def main() -> None:
        watch = SentinelWatch(asyncio.get_running_loop(), [proc.sentinel],
                              lambda: calls.append(1))
        watch.close()
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.sleep(0.3)

    asyncio.run(main())
    proc.join(5)
    assert calls == []


def test_sentinels_are_read_from_vllms_engine_manager_or_none() -> None:
    llm = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(
        engine_manager=SimpleNamespace(sentinels=lambda: [7, 9]))))
    assert core_sentinels(llm) == [7, 9]
    # Another vLLM (an external or Ray-managed engine): nothing to watch, no error.
    assert core_sentinels(SimpleNamespace(engine_core=SimpleNamespace(resources=None))) == []
    assert core_sentinels(object()) == []


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

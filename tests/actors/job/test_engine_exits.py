"""A stream on an engine whose local process exits fails over at once, not when Ray notices.

First the batcher's wiring and the guard's cancellation rules, without Ray: the engine is a
fake whose process is a real local subprocess.  Then the scenario itself: a torch engine,
a supervised Ray actor on this node, SIGKILLed under many streaming rollouts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from erlay.actors.job.domains import EngineBatcher
from erlay.actors.job.engine_exits import EngineExits, EngineProcessExited, ExitGuard
from erlay.supervisor.errors import ChildNotRunning

HERE = "node-here"


class LocalEngine:
    """An engine as a ChildRef shows it, whose process is ``pid`` on node ``node``; its
    ``generate_many`` streams one token per request every 10 ms, forever."""

    def __init__(self, pid: int, node: str = HERE) -> None:
        self.path = "g/e0"
        self.incarnation = 1
        self.process = SimpleNamespace(info={"kind": "actor", "pid": pid, "node_id": node})
        self.actor = self
        self.generate_many = self
        self.open_streams = 0

    def remote(self, requests: list[dict[str, Any]]) -> AsyncIterator[list[dict[str, Any]]]:
        async def stream() -> AsyncIterator[list[dict[str, Any]]]:
            self.open_streams += 1
            try:
                while True:
                    await asyncio.sleep(0.01)
                    yield [{"request_id": r["request_id"], "token_ids": [1]} for r in requests]
            finally:
                self.open_streams -= 1
        return stream()


def batcher_on(node: str) -> EngineBatcher:
    batcher = EngineBatcher()
    batcher.exits = EngineExits(node_id=node)
    return batcher


async def rollouts(batcher: EngineBatcher, engine: Any, n: int
                   ) -> tuple[list[asyncio.Task[BaseException]], list[int]]:
    """``n`` rollouts streaming from ``engine``, started once each has had a chunk: each
    task returns the error its stream raised.  The list counts each one's chunks."""
    counts = [0] * n

    async def rollout(i: int) -> BaseException:
        try:
            async for _ in batcher.stream(engine, {"request_id": f"r{i}/t0/0"}):
                counts[i] += 1
        except (ChildNotRunning, asyncio.CancelledError) as exc:
            return exc
        raise AssertionError("the stream finished")

    tasks = [asyncio.create_task(rollout(i)) for i in range(n)]
    while not all(counts):
        await asyncio.sleep(0.01)
    return tasks, counts


def test_a_local_engine_process_exit_fails_every_waiting_stream_naming_the_pid(
        sleeper: subprocess.Popen[bytes]) -> None:
    engine = LocalEngine(sleeper.pid)
    batcher = batcher_on(HERE)

    async def scenario() -> tuple[list[BaseException], int]:
        tasks, _ = await rollouts(batcher, engine, 3)
        watching = batcher.exits.watching
        sleeper.kill()
        errors = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return errors, watching

    errors, watching = asyncio.run(scenario())
    assert watching == 1   # one pidfd for the one call's engine
    for error in errors:
        assert isinstance(error, ChildNotRunning)
        assert isinstance(error.__cause__, EngineProcessExited)
        assert f"(pid {sleeper.pid}) exited" in str(error)
    assert batcher.exits.watching == 0 and engine.open_streams == 0   # nothing left open


def test_an_engine_on_another_node_is_left_to_ray(sleeper: subprocess.Popen[bytes]) -> None:
    engine = LocalEngine(sleeper.pid, node="node-elsewhere")
    batcher = batcher_on(HERE)

    async def scenario() -> tuple[int, list[int], list[int]]:
        tasks, counts = await rollouts(batcher, engine, 2)
        watching = batcher.exits.watching
        sleeper.kill()
        sleeper.wait()
        at_exit = list(counts)
        while counts[0] < at_exit[0] + 5:   # the stream goes on: only Ray could end it
            await asyncio.sleep(0.01)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return watching, at_exit, counts

    watching, at_exit, counts = asyncio.run(scenario())
    assert watching == 0
    assert all(now > then for now, then in zip(counts, at_exit, strict=True))


def test_stopping_the_coordinator_cancels_the_call_as_before_and_closes_the_pidfd(
        sleeper: subprocess.Popen[bytes]) -> None:
    engine = LocalEngine(sleeper.pid)
    batcher = batcher_on(HERE)

    async def scenario() -> tuple[list[BaseException], bool]:
        tasks, _ = await rollouts(batcher, engine, 2)
        [call] = batcher._tasks
        call.cancel()   # what stopping the coordinator's loop does to every task
        errors = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await asyncio.gather(call, return_exceptions=True)
        return errors, call.cancelled()

    errors, cancelled = asyncio.run(scenario())
    assert cancelled
    assert all(isinstance(e, asyncio.CancelledError) for e in errors)
    assert batcher.exits.watching == 0 and engine.open_streams == 0


# ----------------------------------------------------------------- the guard's rules
def exited_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


async def seen(guard: ExitGuard) -> None:
    """Return in the loop turn the guard's callback ran, or the next one, before the task
    it cancelled has resumed."""
    while not guard.exited:
        await asyncio.sleep(0)


def test_an_exit_ends_the_guarded_block_with_engine_process_exited() -> None:
    async def scenario() -> tuple[BaseException, int]:
        guard = EngineExits(node_id=HERE).guard(LocalEngine(exited_pid()))  # type: ignore[arg-type]

        async def call() -> BaseException:
            try:
                with guard:
                    await asyncio.sleep(30)
            except EngineProcessExited as exc:
                return exc
            raise AssertionError("the block was not ended")

        task = asyncio.create_task(call())
        error = await asyncio.wait_for(task, 10)
        return error, task.cancelling()

    error, cancelling = asyncio.run(scenario())
    assert "exited" in str(error) and cancelling == 0


def test_a_cancellation_from_outside_beside_the_exit_still_propagates() -> None:
    async def scenario() -> bool:
        guard = EngineExits(node_id=HERE).guard(LocalEngine(exited_pid()))  # type: ignore[arg-type]

        async def call() -> None:
            with guard:
                await asyncio.sleep(30)

        task = asyncio.create_task(call())
        await seen(guard)
        task.cancel()   # the coordinator stops in the same turn as the exit
        await asyncio.gather(task, return_exceptions=True)
        return task.cancelled()

    assert asyncio.run(scenario())


def test_an_item_that_raced_the_exit_does_not_hide_it() -> None:
    """The exit's cancellation lands as an awaited result arrives; Python 3.11's
    ``wait_for`` then returns the result and drops the cancellation."""
    async def scenario() -> tuple[list[str], BaseException, int]:
        guard = EngineExits(node_id=HERE).guard(LocalEngine(exited_pid()))  # type: ignore[arg-type]
        item: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        got: list[str] = []

        async def call() -> BaseException:
            try:
                with guard:
                    got.append(await asyncio.wait_for(item, 30))
                    guard.raise_if_exited()
                    await asyncio.sleep(30)
            except EngineProcessExited as exc:
                return exc
            raise AssertionError("the block was not ended")

        task = asyncio.create_task(call())
        await seen(guard)
        item.set_result("chunk")
        error = await asyncio.wait_for(task, 10)
        await asyncio.sleep(0)   # no cancellation is left pending on the task
        return got, error, task.cancelling()

    got, error, cancelling = asyncio.run(scenario())
    assert got == ["chunk"]   # the race happened: the item arrived despite the cancel
    assert isinstance(error, EngineProcessExited) and cancelling == 0


# -------------------------------------------------------- a torch engine on local Ray
@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_sigkilled_torch_engines_streams_fail_over_within_50_ms() -> None:
    import torch

    from erlay.actors.engine.api import GenerationRequest
    from erlay.actors.engine.torch_engine import TorchEngine
    from erlay.actors.model.policy import PolicyConfig
    from erlay.actors.model.tokenizer import CharTokenizer
    from erlay.supervisor.spec import ActorStart, ChildSpec, SupervisorFlags
    from erlay.supervisor.tree import SupervisionTree

    torch.manual_seed(0)
    config = PolicyConfig(vocab_size=CharTokenizer().vocab_size, d_model=32, n_layers=1,
                          n_heads=2, d_ff=64, max_seq_len=4096)
    tree = SupervisionTree("ex", SupervisorFlags(), [ChildSpec("engine", ActorStart(
        TorchEngine, kwargs={"model_config": config.to_dict(), "max_batch": 64},
        options={"num_cpus": 0}))]).start()
    try:
        engine = tree.ref("ex/engine")
        pid = int(engine.process.info["pid"])

        async def scenario() -> tuple[float, list[tuple[float, BaseException]], int]:
            batcher = EngineBatcher()
            done: list[tuple[float, BaseException]] = []
            streaming: set[int] = set()

            async def rollout(i: int) -> None:
                request = GenerationRequest(f"r{i}/t0/0", (1, 40, 41, 42), 4000, seed=i,
                                            stop_ids=(), chunk_tokens=1)
                try:
                    async for _ in batcher.stream(engine, request.to_dict()):
                        streaming.add(i)
                except ChildNotRunning as exc:
                    done.append((time.monotonic(), exc))

            tasks = [asyncio.create_task(rollout(i)) for i in range(32)]
            while len(streaming) < len(tasks):
                await asyncio.sleep(0.01)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return killed_at, done, batcher.exits.watching

        killed_at, done, watching = asyncio.run(scenario())
    finally:
        tree.stop()
    latency_ms = [(at - killed_at) * 1e3 for at, _ in done]
    print(f"kill -> stream error: max {max(latency_ms):.1f} ms, "
          f"min {min(latency_ms):.1f} ms over {len(done)} streams")
    assert len(done) == 32 and watching == 0
    assert all(isinstance(e.__cause__, EngineProcessExited) and f"pid {pid}" in str(e)
               for _, e in done)
    assert max(latency_ms) < 50

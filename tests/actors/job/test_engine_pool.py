"""The engine pool's admission, without Ray: a restarted engine must load the current
weights before it serves, and while it loads, the engines that already serve take the work
(a failover never waits on a restart when there is somewhere else to go).  An engine whose
decode loop died (``EngineFailed``) counts as gone, like a dead actor."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from erlay.actors.engine.api import EngineFailed
from erlay.actors.job.domains import EngineBatcher, EnginePool, EngineRequestFailed
from erlay.actors.model.refit import Refit, RefitManifest
from erlay.supervisor.errors import ChildNotRunning


class FakeEngine:
    """An engine as a ChildRef shows it.  ``update_weights.remote`` completes once ``loads``
    is set; ``running`` False makes it look restarting."""

    def __init__(self, path: str, incarnation: int = 1, running: bool = True,
                 failure: BaseException | None = None) -> None:
        self.path = path
        self.incarnation = incarnation
        self.running = running
        self.failure = failure   # what its calls raise: its decode loop died
        self.loads = asyncio.Event()
        self.loaded: list[int] = []
        self.actor = self
        self.update_weights = self

    @property
    def process(self) -> Any:
        if not self.running:
            raise ChildNotRunning(f"{self.path} is restarting")
        return object()

    def remote(self, refit: Refit) -> Any:
        async def load() -> int:
            if self.failure is not None:
                raise self.failure
            await self.loads.wait()
            self.loaded.append(refit.version)
            return refit.version
        return load()


def weights(version: int) -> Refit:
    """A published version with no buckets (the fakes never fetch them)."""
    return Refit(RefitManifest(version, "float32", ()), ())


class FakeTree:
    def __init__(self, *engines: FakeEngine) -> None:
        self.engines = {e.path: e for e in engines}

    def ref(self, path: str) -> FakeEngine:
        return self.engines[path]


def pool_of(*engines: FakeEngine, serving: tuple[FakeEngine, ...] = ()) -> EnginePool:
    """A pool over ``engines`` with weights v3 published; ``serving`` are admitted."""
    pool = EnginePool(FakeTree(*engines), [e.path for e in engines])  # type: ignore[arg-type]
    pool.weights = weights(3)
    for engine in serving:
        pool._admitted[engine.path] = engine.incarnation
    return pool


async def admitted(pool: EnginePool, engine: FakeEngine) -> None:
    while pool._admitted.get(engine.path) != engine.incarnation:
        await asyncio.sleep(0.01)


def test_a_failover_takes_the_serving_engine_while_a_restart_loads_its_weights() -> None:
    serving, restarted = FakeEngine("g/e0"), FakeEngine("g/e1", incarnation=2)
    pool = pool_of(serving, restarted, serving=(serving,))

    async def scenario() -> list[str]:
        # The restart's load has not finished: the serving engine is taken, at once.
        picked = [(await asyncio.wait_for(pool.acquire(), 10)).path]
        restarted.loads.set()   # the load the first call started, in the background
        await asyncio.wait_for(admitted(pool, restarted), 10)
        picked.append((await pool.acquire()).path)   # the least loaded now
        return picked

    assert asyncio.run(scenario()) == ["g/e0", "g/e1"]
    assert restarted.loaded == [3]


def test_with_no_engine_serving_a_call_waits_for_the_first_admission() -> None:
    down, restarted = FakeEngine("g/e0", running=False), FakeEngine("g/e1", incarnation=2)
    pool = pool_of(down, restarted)

    async def scenario() -> str:
        call = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.2)
        assert not call.done()   # nothing serves: it cannot return yet
        restarted.loads.set()
        return (await asyncio.wait_for(call, 10)).path

    assert asyncio.run(scenario()) == "g/e1"


def test_an_engine_that_failed_the_caller_is_not_handed_back() -> None:
    dead, other = FakeEngine("g/e0"), FakeEngine("g/e1")
    pool = pool_of(dead, other, serving=(dead, other))
    for _ in range(3):
        picked = asyncio.run(pool.acquire(exclude=frozenset({("g/e0", 1)})))
        assert picked.path == "g/e1"


def test_a_caller_giving_up_leaves_the_admission_running_for_the_next() -> None:
    restarted = FakeEngine("g/e1", incarnation=2)
    pool = pool_of(restarted)

    async def scenario() -> str:
        with pytest.raises(ChildNotRunning):
            await pool.acquire(timeout_s=0.2)
        restarted.loads.set()
        await asyncio.wait_for(admitted(pool, restarted), 10)
        return (await pool.acquire(timeout_s=1)).path

    assert asyncio.run(scenario()) == "g/e1"
    assert restarted.loaded == [3]   # one load, shared, not one per caller


def test_a_weight_push_passes_over_an_engine_whose_decode_loop_died() -> None:
    failed = FakeEngine("g/e0", failure=EngineFailed("vLLM's engine died"))
    live = FakeEngine("g/e1")
    live.loads.set()
    pool = pool_of(failed, live, serving=(failed, live))
    asyncio.run(pool.publish(weights(4)))   # does not raise
    assert pool._admitted == {"g/e1": 1} and live.loaded == [4]


class FailingStream:
    """``actor.generate_many.remote(...)``: one chunk for each request, then ``failure``."""

    def __init__(self, failure: BaseException) -> None:
        self.failure = failure
        self.path = "g/e0"
        self.incarnation = 1
        self.process = SimpleNamespace(info={"kind": "fake"})   # no process to watch
        self.actor = self
        self.generate_many = self

    def remote(self, requests: list[dict[str, Any]]) -> Any:
        async def stream() -> Any:
            yield [{"request_id": r["request_id"], "start": 0} for r in requests]
            raise self.failure
        return stream()


def failure_seen(failure: BaseException) -> BaseException:
    async def consume() -> BaseException:
        try:
            async for _ in EngineBatcher().stream(FailingStream(failure),  # type: ignore[arg-type]
                                                  {"request_id": "r/t0/0"}):
                pass
        except ChildNotRunning as exc:
            return exc
        raise AssertionError("the stream did not fail")
    return asyncio.run(consume())


def test_a_stream_whose_engine_failed_fails_over_as_from_a_dead_engine() -> None:
    seen = failure_seen(EngineFailed("decode loop failed"))
    assert not isinstance(seen, EngineRequestFailed)   # the engine is excluded, not retried
    assert isinstance(failure_seen(ValueError("a refused request")), EngineRequestFailed)


def test_the_engines_failure_time_reaches_the_rollout_through_the_error() -> None:
    import pickle

    from ray.exceptions import RayTaskError

    from erlay.actors.job.domains import engine_failed_at

    failure = EngineFailed("vLLM's EngineCore process exited")
    failure.failed_at = 123.5
    # It crosses Ray pickled, and arrives as a RayTaskError that is also an EngineFailed but
    # holds the engine's own error (with its attributes) only as .cause.
    carried = pickle.loads(pickle.dumps(failure))
    assert carried.failed_at == 123.5
    raised = RayTaskError("generate_many", "traceback", carried).as_instanceof_cause()
    assert isinstance(raised, EngineFailed) and raised.failed_at is None
    assert engine_failed_at(failure_seen(raised)) == 123.5
    assert engine_failed_at(failure_seen(carried)) == 123.5
    assert engine_failed_at(failure_seen(ValueError("refused"))) is None

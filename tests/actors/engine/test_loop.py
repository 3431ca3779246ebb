"""The torch engine's decode loop driven in-process, without Ray: the paths whose timing a Ray
test cannot pin down (aborting a waiting request, a consumer leaving, a failing loop)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from erlay.actors.engine.api import (
    EngineFailed,
    GenerationRequest,
    RefitUnavailable,
    TokenChunk,
    WeightsMismatch,
)
from erlay.actors.engine.torch_engine import TorchEngine
from erlay.actors.model.policy import PolicyConfig
from erlay.actors.model.refit import Refit, put_refit
from erlay.actors.model.tokenizer import CharTokenizer

CONFIG = PolicyConfig(vocab_size=CharTokenizer().vocab_size, d_model=32, n_layers=1, n_heads=2,
                      d_ff=64, max_seq_len=96).to_dict()


def engine(**kw: Any) -> TorchEngine:
    # Keep this process's thread count; the engine would otherwise set it globally.
    return TorchEngine(CONFIG, torch_threads=torch.get_num_threads(), **kw)


def request(rid: str, new: int = 80, **kw: Any) -> dict[str, Any]:
    kw.setdefault("stop_ids", ())
    return GenerationRequest(rid, (1, 10, 11), new, seed=7, **kw).to_dict()


def local_refit(version: int, state: dict[str, Any]) -> Refit:
    """``state`` as a refit whose buckets are already-resolved futures of this loop (no Ray:
    the engine awaits each bucket under its deadline, whatever the awaitable)."""
    loop = asyncio.get_running_loop()

    def put(buffer: Any) -> asyncio.Future[Any]:
        future = loop.create_future()
        future.set_result(buffer)
        return future
    return put_refit(version, state, "float32", put=put)


async def drain(stream: AsyncIterator[dict[str, Any]]) -> list[TokenChunk]:
    return [TokenChunk.from_dict(c) async for c in stream]


async def first(stream: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    return await anext(stream)


def test_aborting_a_waiting_request_ends_it_with_an_empty_abort_chunk() -> None:
    async def scenario() -> tuple[TokenChunk, list[TokenChunk]]:
        eng = engine(max_batch=1)
        running = eng.generate(request("running", chunk_tokens=1))
        await anext(running)  # "running" holds the only slot
        waiting = asyncio.create_task(first(eng.generate(request("waiting"))))
        await asyncio.sleep(0)  # let "waiting" be submitted; it cannot be admitted
        assert await eng.abort("waiting") is True
        return TokenChunk.from_dict(await waiting), await drain(running)

    chunk, rest = asyncio.run(scenario())
    assert chunk.finished and chunk.finish_reason == "abort"
    assert chunk.token_ids == () and chunk.start == 0
    assert rest[-1].finish_reason == "length"


def test_consumer_closing_its_stream_early_aborts_the_request() -> None:
    async def scenario() -> dict[str, Any]:
        eng = engine()
        stream = eng.generate(request("leaver", chunk_tokens=1))
        await anext(stream)
        await stream.aclose()
        await drain(eng.generate(request("next", 4)))  # one more step applies the abort
        return await eng.stats()

    stats = asyncio.run(scenario())
    assert stats["requests_aborted"] == 1 and stats["requests_finished"] == 1
    assert stats["running"] == 0 and stats["tokens_generated"] < 80 + 4


def test_duplicate_request_id_is_refused_while_the_first_runs() -> None:
    async def scenario() -> None:
        eng = engine()
        first = eng.generate(request("dup", chunk_tokens=1))
        await anext(first)
        with pytest.raises(ValueError, match="already being generated"):
            await anext(eng.generate(request("dup")))
        await drain(first)

    asyncio.run(scenario())


def test_mismatched_weights_are_refused_and_the_version_is_kept() -> None:
    async def scenario() -> int:
        eng = engine(version=3)
        state = {"embed.weight": np.zeros((5, 5), dtype=np.float32)}
        with pytest.raises(WeightsMismatch, match="missing"):
            await eng.update_weights(local_refit(4, state))
        return await eng.version()

    assert asyncio.run(scenario()) == 3


def test_a_refit_whose_bucket_never_comes_times_out_and_keeps_the_version() -> None:
    async def scenario() -> tuple[int, bool]:
        eng = engine(version=3, refit_bucket_timeout_s=0.2)
        before = {k: v.clone() for k, v in eng.model.state_dict().items()}
        state = {k: np.zeros(tuple(v.shape), dtype=np.float32)
                 for k, v in eng.model.state_dict().items()}
        good = local_refit(4, state)
        never = asyncio.get_running_loop().create_future()   # a fetch that hangs
        with pytest.raises(RefitUnavailable, match=r"no answer within 0\.2 s"):
            await eng.update_weights(replace(good, refs=(*good.refs[:-1], never)))
        same = all(torch.equal(before[k], v) for k, v in eng.model.state_dict().items())
        return await eng.version(), same

    assert asyncio.run(scenario()) == (3, True)


def test_failing_decode_loop_fails_held_requests_and_reports_an_exit() -> None:
    async def scenario() -> tuple[BaseException, dict[str, Any]]:
        eng = engine()
        poisoned = {k: np.full_like(v.numpy(), np.nan)
                    for k, v in eng.model.state_dict().items()}
        assert await eng.update_weights(local_refit(1, poisoned)) == 1
        with pytest.raises(EngineFailed, match="finite probability") as failed:
            await drain(eng.generate(request("victim")))
        exit_reason = await asyncio.wait_for(eng.erlay_wait(), 5)
        with pytest.raises(EngineFailed):  # refused from now on; the supervisor restarts it
            await anext(eng.generate(request("later")))
        return failed.value, exit_reason

    error, exit_reason = asyncio.run(scenario())
    assert exit_reason["kind"] == "error" and "decode loop failed" in exit_reason["detail"]
    assert "ValueError" in str(error)


def test_shutdown_ends_open_streams_with_abort() -> None:
    async def scenario() -> list[TokenChunk]:
        eng = engine()
        stream = eng.generate(request("open", chunk_tokens=1))
        first = TokenChunk.from_dict(await anext(stream))
        eng.erlay_terminate()
        return [first, *await drain(stream)]

    chunks = asyncio.run(scenario())
    assert chunks[-1].finished and chunks[-1].finish_reason == "abort"
    assert chunks[-1].start == sum(len(c.token_ids) for c in chunks[:-1])


def test_decode_step_failpoint_raise_fails_the_loop_as_a_crash_would() -> None:
    from erlay.supervisor import failpoints

    async def scenario() -> dict[str, Any]:
        eng = engine()
        failpoints.arm("generation.decode_step", "raise", nth=3)
        try:
            with pytest.raises(EngineFailed, match="FailpointError"):
                await drain(eng.generate(request("victim")))
        finally:
            failpoints.disarm_all()
        return await asyncio.wait_for(eng.erlay_wait(), 5)

    assert asyncio.run(scenario())["kind"] == "error"


def test_decode_step_failpoint_hang_stops_progress_while_the_engine_answers() -> None:
    from erlay.supervisor import failpoints

    async def scenario() -> tuple[int, int, list[TokenChunk]]:
        eng = engine()
        failpoints.arm("generation.decode_step", "hang", nth=2)
        try:
            stream = asyncio.create_task(drain(eng.generate(request("stalled", 8))))
            while failpoints.hits("generation.decode_step") < 2:
                await asyncio.sleep(0.01)
            before = eng.progress.snapshot().counter
            await asyncio.sleep(0.1)
            stats = await eng.stats()  # the actor still answers: only the loop is wedged
            after = eng.progress.snapshot().counter
            assert stats["running"] == 1 and not stream.done()
        finally:
            failpoints.disarm_all()
        return before, after, await asyncio.wait_for(stream, 10)

    before, after, chunks = asyncio.run(scenario())
    assert before == after
    assert chunks[-1].finish_reason == "length"

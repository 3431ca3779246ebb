"""The torch engine's sleep and wake-up (colocated placement), driven in-process without Ray:
the cache is gone while asleep, new requests are refused, held ones continue after the wake
with the tokens an unbroken run makes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from erlay.actors.engine.api import EngineAsleep, GenerationRequest, TokenChunk
from erlay.actors.engine.torch_engine import TorchEngine
from erlay.actors.model.policy import PolicyConfig
from erlay.actors.model.tokenizer import CharTokenizer

CONFIG = PolicyConfig(vocab_size=CharTokenizer().vocab_size, d_model=32, n_layers=1, n_heads=2,
                      d_ff=64, max_seq_len=96).to_dict()


def engine() -> TorchEngine:
    return TorchEngine(CONFIG, torch_threads=torch.get_num_threads(), seed=3)


def request(rid: str, new: int = 60) -> dict[str, Any]:
    return GenerationRequest(rid, (1, 10, 11), new, seed=7, stop_ids=(),
                             chunk_tokens=1).to_dict()


def tokens(chunks: list[dict[str, Any]]) -> list[int]:
    return [t for c in chunks for t in TokenChunk.from_dict(c).token_ids]


async def unbroken() -> list[int]:
    eng = engine()
    return tokens([c async for c in eng.generate(request("r"))])


def test_a_sleeping_engine_holds_no_cache_and_continues_its_request_identically() -> None:
    async def scenario() -> tuple[list[int], dict[str, Any], dict[str, Any], dict[str, Any]]:
        eng = engine()
        stream = eng.generate(request("r"))
        chunks = [await anext(stream)]   # decoding: the batch holds a KV cache
        assert eng._cache_bytes() > 0
        slept = await eng.sleep(2)
        assert eng._batch._cache is None and eng._batch.rows == []
        stats_asleep = await eng.stats()
        woken = await eng.wake_up(["weights"])   # weights alone: still asleep
        assert woken["asleep"]
        woken = await eng.wake_up(["kv_cache"])
        chunks += [c async for c in stream]
        return tokens(chunks), slept, woken, {**stats_asleep, "final": await eng.stats()}

    got, slept, woken, stats = asyncio.run(scenario())
    assert slept["asleep"] and slept["cache_bytes"] == 0
    assert stats["pending"] == 1 and stats["running"] == 0 and stats["sleeps"] == 1
    assert not woken["asleep"] and stats["final"]["wakes"] == 1
    assert got == asyncio.run(unbroken())


def test_a_sleeping_engine_refuses_new_requests_until_it_wakes() -> None:
    async def scenario() -> list[int]:
        eng = engine()
        await eng.sleep()
        with pytest.raises(EngineAsleep):
            await anext(eng.generate(request("refused")))
        await eng.wake_up()
        return tokens([c async for c in eng.generate(request("r"))])

    assert asyncio.run(scenario()) == asyncio.run(unbroken())


def test_sleep_and_wake_are_idempotent_and_count_only_transitions() -> None:
    async def scenario() -> dict[str, Any]:
        eng = engine()
        await eng.wake_up()             # awake already: nothing happens
        await eng.sleep()
        await eng.sleep()
        await eng.wake_up()
        await eng.wake_up()
        return await eng.stats()

    stats = asyncio.run(scenario())
    assert (stats["sleeps"], stats["wakes"]) == (1, 1)

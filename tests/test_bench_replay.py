"""bench/replay.py's prefill ledger: which generate calls are resumed calls, and what the
engines reported prefilling for them.  No Ray: the batcher's stream is replaced by a script."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bench.replay import PrefillLedger, turn_of
from erlay.actors.job.domains import EngineBatcher
from erlay.supervisor.errors import ChildNotRunning


def request(attempt: int, prompt: int = 5, prefix: int = 0, turn: str = "r00001-g002-3/t0"
            ) -> dict[str, Any]:
    return {"request_id": f"{turn}/ab12cd.{attempt}", "prompt_ids": [7] * prompt,
            "prefix_ids": [9] * prefix}


def chunk(prefill: int) -> dict[str, Any]:
    return {"request_id": "x", "token_ids": [1], "prefill_tokens": prefill}


def test_turn_of_drops_only_the_attempt_from_the_request_id() -> None:
    assert turn_of("r00001-g002-3/t1/ab12cd.17") == "r00001-g002-3/t1"


def test_a_call_after_its_turn_failed_counts_what_its_engine_prefilled_as_recomputed() -> None:
    ledger = PrefillLedger()
    first = ledger.call(request(0))
    ledger.chunk(first, chunk(5))
    ledger.ended(first, failed=True)
    resumed = ledger.call(request(1, prefix=2))
    ledger.chunk(resumed, chunk(6))     # the engine says: 6, not the 7 the call sent
    ledger.chunk(resumed, chunk(0))
    ledger.ended(resumed, failed=False)
    figures = ledger.figures()
    assert (figures["prefill_tokens_recomputed"], figures["resumed_calls"],
            figures["resumed_context_tokens"], figures["resumed_prefix_tokens"]) == (6, 1, 7, 2)
    assert figures["prefill_tokens_all_calls"] == 11
    assert figures["prefill_recomputed_ratio"] == pytest.approx(6 / 11, abs=1e-4)


def test_calls_of_a_turn_that_never_failed_are_not_resumed_even_with_a_prefix() -> None:
    ledger = PrefillLedger()
    replayed = ledger.call(request(0, prefix=3))   # a journaled turn continued after a restart
    ledger.chunk(replayed, chunk(8))
    ledger.ended(replayed, failed=False)
    assert ledger.figures()["resumed_calls"] == 0
    assert ledger.figures()["prefill_tokens_recomputed"] == 0


def test_a_resumed_call_whose_engine_dies_before_its_first_chunk_is_unreported() -> None:
    ledger = PrefillLedger()
    ledger.ended(ledger.call(request(0)), failed=True)
    ledger.ended(ledger.call(request(1, prefix=1)), failed=True)
    again = ledger.call(request(2, prefix=1))
    ledger.chunk(again, chunk(6))
    ledger.ended(again, failed=False)
    figures = ledger.figures()
    assert (figures["resumed_calls"], figures["resumed_calls_unreported"],
            figures["prefill_tokens_recomputed"]) == (2, 1, 6)
    assert (figures["resumed_context_tokens"], figures["resumed_reported_context_tokens"]) \
        == (12, 6)


def test_listening_feeds_the_ledger_from_the_batcher_streams_and_then_lets_go(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def scripted(batcher: EngineBatcher, engine: Any, request: dict[str, Any]
                       ) -> AsyncIterator[dict[str, Any]]:
        if request["request_id"].endswith(".0"):
            yield chunk(5)
            raise ChildNotRunning("engine-0 died")
        yield chunk(len(request["prompt_ids"]) + len(request["prefix_ids"]))

    monkeypatch.setattr(EngineBatcher, "stream", scripted)

    async def rollout(batcher: EngineBatcher) -> list[int]:
        got: list[int] = []
        for attempt in range(2):
            try:
                async for c in batcher.stream(None, request(attempt, prefix=len(got))):
                    got += c["token_ids"]
            except ChildNotRunning:
                continue
        return got

    ledger = PrefillLedger()
    with ledger.listening():
        assert asyncio.run(rollout(EngineBatcher())) == [1, 1]
    assert EngineBatcher.stream is scripted
    assert ledger.figures()["prefill_tokens_recomputed"] == 6
    assert ledger.figures()["resumed_calls"] == 1

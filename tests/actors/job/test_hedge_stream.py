"""A hedged turn through the real RolloutRunner, with fake engines whose timing is fixed: the
hedge races the first stream into one token list, each position is journaled once, the
loser is cancelled and aborted, and a hedge that diverges is dropped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from erlay.actors.job.hedge import StreamDiverged, TurnTokens
from erlay.actors.job.rollout import RolloutRunner, SamplingParams, Trajectory, TurnHistory
from erlay.actors.journal.transitions import MemoryTransitions, TransitionKind

BUDGET = 20


class Engine:
    """``delay_s`` per token, or ``fast_first`` tokens of a stream at 1 ms first."""

    def __init__(self, path: str, delay_s: float, offset: int = 0, fast_first: int = 0,
                 stall_after: int | None = None) -> None:
        self.path, self.incarnation, self.delay_s, self.offset = path, 0, delay_s, offset
        self.fast_first = fast_first
        self.stall_after = stall_after   # positions after which it never sends again
        self.aborted: list[str] = []
        self.actor = SimpleNamespace(abort=SimpleNamespace(remote=self.aborted.append))


class Pool:
    def __init__(self, *engines: Engine) -> None:
        self.engines = engines
        self.weights = None

    async def acquire(self, exclude: frozenset[tuple[str, int]] = frozenset()) -> Engine:
        return next(e for e in self.engines if (e.path, e.incarnation) not in exclude)

    def release(self, engine: Engine) -> None:
        pass


class Batcher:
    """Streams one token per chunk: token ``100 + position + engine.offset``, every
    ``engine.delay_s``, from the request's prefix to the budget."""

    async def stream(self, engine: Engine, request: dict[str, Any]) -> AsyncIterator[dict]:
        start = len(request["prefix_ids"])
        end = start + request["max_new_tokens"]
        for pos in range(start, end):
            if engine.stall_after is not None and pos >= engine.stall_after:
                await asyncio.sleep(3600)   # a stalled engine: its stream just stops
            await asyncio.sleep(0.001 if pos - start < engine.fast_first else engine.delay_s)
            yield {"request_id": request["request_id"], "start": pos,
                   "token_ids": [100 + pos + engine.offset], "logprobs": [-0.5], "version": 1,
                   "finished": pos == end - 1,
                   "finish_reason": "length" if pos == end - 1 else None}


class Control:
    def __init__(self) -> None:
        self.due = 0
        self.cut: list[tuple[str, int]] = []

    def hedge_after(self) -> float:
        return 0.05

    def hedge_due(self, rollout_id: str, step: int, running_s: float) -> bool:
        self.due += 1
        return True

    def stream_finished(self, engine: str, tokens: int, seconds: float) -> None:
        pass

    def stream_failed(self, engine: str) -> None:
        pass

    def stream_cut(self, engine: str, tokens: int, seconds: float) -> None:
        self.cut.append((engine, tokens))


def generate(slow: Engine, fast: Engine) -> tuple[RolloutRunner, MemoryTransitions, list[int]]:
    sink = MemoryTransitions()
    runner = RolloutRunner(SimpleNamespace(tools=()),  # type: ignore[arg-type]
                           SimpleNamespace(stop_ids=[0]),  # type: ignore[arg-type]
                           Pool(slow, fast), None, None, sink,  # type: ignore[arg-type]
                           SamplingParams(BUDGET, 1.0, 1, 0), 100,
                           control=Control())  # type: ignore[arg-type]
    runner.batcher = Batcher()  # type: ignore[assignment]
    traj = Trajectory("r00000-g000-0", 0, 0, 0, [1, 2, 3])
    tokens, _, _ = asyncio.run(runner._generate("r00000-g000-0", 0, [1, 2, 3], 7, BUDGET, traj,
                                                TurnHistory()))
    return runner, sink, tokens


def positions(sink: MemoryTransitions) -> list[int]:
    out = []
    for t in sink.of(TransitionKind.CHUNK):
        out += range(t.data["start"], t.data["start"] + len(t.data["token_ids"]))
    return out


def test_the_hedge_wins_each_position_is_journaled_once_and_the_loser_is_aborted() -> None:
    slow, fast = Engine("e0", 0.04), Engine("e1", 0.008)
    runner, sink, tokens = generate(slow, fast)
    assert tokens == [100 + i for i in range(BUDGET)]
    assert positions(sink) == list(range(BUDGET))      # once each, in order
    assert runner.hedges == 1
    assert runner.hedge_tokens_twice > 0               # the slow stream kept sending
    assert slow.aborted and not fast.aborted           # the loser's request stopped
    hedge_chunks = [t for t in sink.of(TransitionKind.CHUNK) if "continued_at" in t.data]
    assert len(hedge_chunks) == 1 and hedge_chunks[0].data["engine"] == "e1"


def test_a_hedge_that_wins_does_not_wait_for_a_stalled_first_stream() -> None:
    slow, fast = Engine("e0", 0.01, stall_after=3), Engine("e1", 0.002)
    started = time.monotonic()
    runner, sink, tokens = generate(slow, fast)
    assert time.monotonic() - started < 5.0
    assert tokens == [100 + i for i in range(BUDGET)] and positions(sink) == list(range(BUDGET))
    assert slow.aborted and runner.hedges == 1
    # The stalled engine's cut stream still counts against it: 3 tokens in its time.
    assert runner.control.cut == [("e0", 3)]  # type: ignore[union-attr]


def test_a_hedge_that_diverges_leaves_one_consistent_sequence() -> None:
    # The hedge samples other tokens (another weights version, say), runs ahead for a few
    # positions, then falls behind.  The first stream meets the hedge's tokens where they
    # differ and is dropped: the turn is the first stream's tokens up to the hedge's start
    # and the hedge's after it, never a mix (which a merge without the check would make).
    # The first stream sends at 20, 40, 60 ms; the hedge starts at 50 ms (hedge_after) and
    # sends its first four tokens within 5 ms: it reaches position 2 first.
    slow, fast = Engine("e0", 0.02), Engine("e1", 0.03, offset=1000, fast_first=4)
    runner, sink, tokens = generate(slow, fast)
    assert positions(sink) == list(range(BUDGET))
    switch = next((i for i, t in enumerate(tokens) if t >= 1000), BUDGET)
    assert 0 < switch < BUDGET
    assert tokens == [100 + i for i in range(switch)] + [1100 + i
                                                         for i in range(switch, BUDGET)]
    assert runner.hedges == 1


def test_new_part_compares_the_chunk_tuple_with_the_held_list() -> None:
    turn = TurnTokens([1, 2, 3], [0.0] * 3, [1] * 3, streams=2)
    assert turn.new_part(1, (2, 3, 4)) == 2          # equal tokens, as a chunk's tuple
    assert turn.new_part(3, (4,)) == 0
    with pytest.raises(StreamDiverged):
        turn.new_part(2, (9, 4))

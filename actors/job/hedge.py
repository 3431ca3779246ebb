"""One turn's generation, raced by a hedge when it straggles.

A turn's tokens live in one :class:`TurnTokens`, shared by every stream generating it.  The
first stream (with its own failovers) runs as before; when the goodput controller says the
turn straggles (:meth:`~erlay.actors.control.GoodputController.hedge_due`), :func:`race`
starts a second stream on another engine from the tokens received so far.  Both write into
the same :class:`TurnTokens`: a chunk adds only the positions nobody has added yet, so each
position is journaled once, by whichever stream reached it first.  The first stream to
finish the turn wins; the other is cancelled (its request aborted).

Why the two copies may be merged: the torch engine samples position ``i`` of a rollout from
``(seed, i)`` alone, so a continuation from a prefix produces the tokens the first stream
would have.  A stream whose tokens disagree with the ones already taken (another weights
version reached one engine first, or a backend without that guarantee) raises
:class:`StreamDiverged` and is dropped; the other goes on.  Hedging is therefore offered
only on the torch engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("erlay.rollout")

POLL_S = 0.1   # how often a running turn asks whether it straggles


class StreamDiverged(Exception):
    """A stream's tokens differ from the ones the turn already holds at those positions."""


@dataclass
class TurnTokens:
    """What one turn has received so far, from any of its streams."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    streams: int = 0          # streams started on this turn (2 once hedged)
    done: bool = False        # a stream finished it: the others record nothing more
    engines: set[tuple[str, int]] = field(default_factory=set)   # streaming it now

    def new_part(self, start: int, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (a chunk beginning at position ``start``) are already
        held; raises :class:`StreamDiverged` when, with two streams, those differ."""
        overlap = max(0, min(len(self.token_ids) - start, len(token_ids)))
        if overlap and self.streams > 1 \
                and list(token_ids[:overlap]) != self.token_ids[start:start + overlap]:
            raise StreamDiverged(f"tokens at {start}..{start + overlap} differ")
        return overlap


async def race(stream: Callable[[bool], Awaitable[None]], turn: TurnTokens,
               hedge_due: Callable[[float], bool], not_before_s: float = 0.0) -> int:
    """Run ``stream(False)`` to the end of the turn, and ``stream(True)`` beside it once
    ``hedge_due(seconds running)`` says so; the first to finish wins and the other is
    cancelled (a first stream waiting on a stalled engine too).  Returns the hedges started
    (0 or 1).  A stream that fails while the other runs is dropped; the last one's error
    propagates.

    ``hedge_due`` is first asked after ``not_before_s`` (the straggler threshold), then every
    :data:`POLL_S`, from a timer: a turn that ends before the threshold costs one task and
    one timer, and never wakes up for it."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    primary = asyncio.ensure_future(stream(False))
    hedge: asyncio.Future[None] | None = None

    def hedge_done(task: asyncio.Future[None]) -> None:
        if not task.cancelled() and task.exception() is None:
            primary.cancel()   # the hedge finished the turn (a no-op if primary did)

    def check() -> None:
        nonlocal hedge, timer
        if primary.done():
            return
        if hedge_due(loop.time() - started):
            hedge = asyncio.ensure_future(stream(True))
            hedge.add_done_callback(hedge_done)
        else:
            timer = loop.call_later(POLL_S, check)

    def hedge_won() -> bool:
        return hedge is not None and hedge.done() and not hedge.cancelled() \
            and hedge.exception() is None

    timer = loop.call_later(max(0.0, not_before_s), check)
    try:
        try:
            await primary
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if (task is not None and task.cancelling()) or not hedge_won():
                raise   # our own cancellation, not the hedge's win
        except Exception as error:
            if hedge is None:
                raise
            log.debug("the first stream of a hedged turn was dropped: %s", error)
            await hedge   # the hedge finishes the turn, or its error propagates
        return 0 if hedge is None else 1
    finally:
        timer.cancel()
        others = [t for t in (primary, hedge) if t is not None and not t.done()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)

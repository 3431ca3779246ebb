"""The goodput controller's state and actions, its adaptive limits and the hedged race of one
turn, without Ray: fake clocks, fake restarters, fake streams."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from erlay.actors.config.control import CallControl, ControlSection, EngineControl
from erlay.actors.control.controller import GoodputController
from erlay.actors.control.limits import CallLimits
from erlay.actors.control.policy import Action
from erlay.actors.job.hedge import StreamDiverged, TurnTokens, race


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Restarter:
    def __init__(self, headroom: int = 5) -> None:
        self.room = headroom
        self.loads: dict[str, int] = {}
        self.restarted: list[str] = []

    def headroom(self) -> int:
        return self.room

    def load(self, path: str) -> int:
        return self.loads.get(path, 0)

    async def restart(self, path: str, reason: str) -> None:
        self.restarted.append(path)


def controller(clock: Clock, **engine: object) -> tuple[GoodputController, list[Action]]:
    knobs = ControlSection(engine=EngineControl(min_samples=2, slow_ticks=1, retry_s=10.0,
                                                retry_max_s=25.0, **engine))
    actions: list[Action] = []
    ctl = GoodputController(knobs, ["e0", "e1"], actions.append, sandbox_deadline_s=5.0,
                            judge_deadline_s=5.0, hedging=True, clock=clock)
    ctl.restarter = Restarter()
    return ctl, actions


def feed(ctl: GoodputController, path: str, rate: float, n: int = 2) -> None:
    for _ in range(n):
        ctl.stream_finished(path, int(rate), 1.0)


def test_route_away_trial_and_backoff_then_healthy() -> None:
    async def main() -> None:
        clock = Clock()
        ctl, actions = controller(clock)
        feed(ctl, "e0", 100), feed(ctl, "e1", 10)
        await ctl.tick()
        assert ctl.avoided == {"e1"} and actions[-1].kind == "route_away"
        assert ctl.pick({"e0": 50, "e1": 0}) == "e0"   # routed away even when idle
        clock.now = 10.0
        await ctl.tick()
        assert actions[-1].kind == "trial" and ctl.avoided == frozenset()
        feed(ctl, "e1", 10)
        await ctl.tick()                               # failed its trial: backoff doubles
        assert actions[-1].kind == "route_away" and ctl.engines["e1"].retry_s == 20.0
        clock.now = 30.0
        await ctl.tick()
        feed(ctl, "e1", 10)
        await ctl.tick()
        assert ctl.engines["e1"].retry_s == 25.0       # capped at retry_max_s
        clock.now = 55.0
        await ctl.tick()
        assert actions[-1].kind == "trial"
        feed(ctl, "e1", 95)
        await ctl.tick()
        assert actions[-1].kind == "healthy" and ctl.engines["e1"].slow_since is None
        assert ctl.avoided == frozenset()
    asyncio.run(main())


def test_a_restart_drains_first_and_goes_through_the_restarter() -> None:
    async def main() -> None:
        clock = Clock()
        ctl, actions = controller(clock, max_failures=2)
        restarter = ctl.restarter
        assert isinstance(restarter, Restarter)
        restarter.loads["e1"] = 3
        ctl.stream_failed("e1")
        clock.now = 1.5
        ctl.stream_failed("e1")
        await ctl.tick()
        assert actions[-1].kind == "restart" and ctl.avoided == {"e1"}
        await asyncio.sleep(0.3)
        assert restarter.restarted == []               # still draining: 3 in flight
        restarter.loads["e1"] = 0
        await asyncio.sleep(0.5)
        assert restarter.restarted == ["e1"] and ctl.avoided == frozenset()
        assert not ctl.engines["e1"].failures
    asyncio.run(main())


def test_no_restart_without_headroom_in_the_intensity() -> None:
    async def main() -> None:
        clock = Clock()
        ctl, actions = controller(clock, max_failures=2)
        assert isinstance(ctl.restarter, Restarter)
        ctl.restarter.room = 1   # intensity_headroom (1) is left to real faults
        ctl.stream_failed("e1")
        clock.now = 1.5
        ctl.stream_failed("e1")
        await ctl.tick()
        assert [a.kind for a in actions] == []
    asyncio.run(main())


def test_failures_of_one_call_count_once() -> None:
    ctl, _ = controller(Clock())
    for _ in range(64):
        ctl.stream_failed("e1")
    assert len(ctl.engines["e1"].failures) == 1


def test_hedge_due_only_for_the_awaited_step_in_its_tail() -> None:
    ctl, actions = controller(Clock())
    for _ in range(40):
        ctl.turn_latency(0.1)
    ctl.awaiting(3, 8)
    assert not ctl.hedge_due("r3-0-0", 3, 1.0)        # 8 of 8 unfinished: not the tail
    for _ in range(6):
        ctl.rollout_finished(3)
    assert not ctl.hedge_due("r3-0-0", 4, 1.0)        # not the step awaited
    assert not ctl.hedge_due("r3-0-0", 3, 0.1)        # not long enough yet
    assert ctl.hedge_due("r3-0-0", 3, 1.0)
    assert actions[-1].kind == "hedge" and "2 of 8 rollouts of step 3" in actions[-1].reason


def test_call_limits_bound_concurrency_per_host_and_tell_changes() -> None:
    async def main() -> None:
        told: list[Action] = []
        knobs = CallControl(min_samples=3, max_concurrency=2, min_concurrency=1,
                            deadline_floor_s=0.2)
        limits = CallLimits("sandbox", knobs, 5.0, told.append)
        running = peak = 0

        async def call() -> None:
            nonlocal running, peak
            async with limits.slot("host-a"):
                running += 1
                peak = max(peak, running)
                await asyncio.sleep(0.01)
                running -= 1

        await asyncio.gather(*(call() for _ in range(10)))
        assert peak == 2
        limits.record("host-a", 5.0, timed_out=True)     # the code hung: not the host's load
        assert limits.limit("host-a") == 2.0 and limits.latencies == deque()
        limits.record("host-a", 5.0, timed_out=True, congested=True)
        assert limits.limit("host-a") == 1.0
        assert [a.kind for a in told] == ["sandbox_concurrency"]
        for _ in range(3):
            limits.record("host-a", 0.05, timed_out=False)
        assert limits.deadline() == pytest.approx(0.2)
        assert told[-1].kind == "sandbox_deadline" and told[-1].value == pytest.approx(0.2)
    asyncio.run(main())


def test_disabled_call_limits_give_the_configured_deadline_and_no_limit() -> None:
    limits = CallLimits("judge", CallControl(enabled=False, min_samples=1), 5.0)
    for _ in range(10):
        limits.record("h", 0.01, timed_out=False)
    assert limits.deadline() == 5.0


def stream_of(turn: TurnTokens, tokens: list[int], delay: float, log: list[str],
              name: str, start: int = 0) -> object:
    """A fake stream: writes ``tokens`` from ``start`` into ``turn`` one position at a time,
    as the runner's _stream does (new positions only; a divergence raises)."""
    async def run() -> None:
        turn.streams += 1
        pos = start
        try:
            for token in tokens[start:]:
                await asyncio.sleep(delay)
                if turn.done:
                    return
                overlap = turn.new_part(pos, [token])
                if not overlap:
                    turn.token_ids.append(token)
                    log.append(f"{name}@{pos}")
                pos += 1
            turn.done = True
            log.append(f"{name} finished")
        except asyncio.CancelledError:
            log.append(f"{name} cancelled")
            raise
    return run()


def test_the_first_stream_to_finish_wins_and_each_position_is_taken_once() -> None:
    async def main() -> None:
        turn = TurnTokens([], [], [])
        log: list[str] = []
        tokens = list(range(20))

        def stream(hedge: bool) -> object:
            if hedge:   # continues from what the turn holds, on a faster engine
                return stream_of(turn, tokens, 0.001, log, "hedge", len(turn.token_ids))
            return stream_of(turn, tokens, 0.05, log, "first")

        hedges = await race(stream, turn, lambda running: running > 0.12)  # type: ignore[arg-type]
        assert hedges == 1
        assert turn.token_ids == tokens
        taken = [e.split("@")[1] for e in log if "@" in e]
        assert sorted(taken, key=int) == [str(i) for i in range(20)] == taken
        assert "hedge finished" in log and "first cancelled" in log
    asyncio.run(main())


def test_a_diverging_hedge_is_dropped_and_the_first_stream_goes_on() -> None:
    async def main() -> None:
        turn = TurnTokens([], [], [])
        log: list[str] = []

        def stream(hedge: bool) -> object:
            if hedge:   # another weights version: different tokens from position 0
                return stream_of(turn, [99] * 10, 0.001, log, "hedge", 0)
            return stream_of(turn, list(range(10)), 0.03, log, "first")

        await race(stream, turn, lambda running: running > 0.05)  # type: ignore[arg-type]
        assert turn.token_ids == list(range(10)) and "first finished" in log
    asyncio.run(main())


def test_without_a_hedge_the_stream_error_propagates() -> None:
    async def main() -> None:
        turn = TurnTokens([], [], [])

        async def failing(hedge: bool) -> None:
            raise StreamDiverged("boom")

        with pytest.raises(StreamDiverged):
            await race(failing, turn, lambda running: False)
    asyncio.run(main())

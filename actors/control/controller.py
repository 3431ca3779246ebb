"""The goodput controller: observes the rollouts, decides with :mod:`.policy`, acts.

One :class:`GoodputController` per coordinator incarnation, on the coordinator's event loop
(its state is rebuilt from observations after a coordinator restart).  It is told:

- by the rollout runner: each finished stream (engine, tokens, seconds), each stream an
  engine failed, each turn's latency, each rollout finished;
- by the coordinator: the step it waits on, and how many rollouts that step has.

It acts through narrow handles, never by reaching into the job:

- routing: :attr:`avoided` and :meth:`pick`, which the engine pool consults on every
  acquisition;
- restarts: an :class:`EngineRestarter` (drain, then kill through the engine's supervisor, so
  the restart is counted against the generation domain's intensity like any other);
- hedging: :meth:`hedge_due`, asked by a turn that has been running a while;
- adaptive limits: the :class:`~erlay.actors.control.limits.CallLimits` of the sandbox and
  the judge clients.

Every action is handed to ``emit`` (the job writes it to ``events.jsonl``, the metrics, the
log and OpenTelemetry) with its reason.  A controller that crashes in its tick logs it and
goes on: it may cost goodput, never the job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from erlay.actors.config.control import ControlSection
from erlay.actors.control.limits import CallLimits
from erlay.actors.control.policy import (
    Action,
    EngineState,
    engine_actions,
    hedge_after,
    may_hedge,
    pick_engine,
)

log = logging.getLogger("erlay.control")

TICK_S = 1.0   # how often engine health is judged


class EngineRestarter(Protocol):
    """How the controller restarts an engine: through its supervisor, never by itself."""

    def headroom(self) -> int:
        """Restarts the generation domain may still take within its intensity."""
        ...

    def load(self, path: str) -> int:
        """Rollouts in flight on ``path``."""
        ...

    async def restart(self, path: str, reason: str) -> None:
        """Kill ``path``'s current incarnation as its supervisor would (a counted exit)."""
        ...


class GoodputController:
    """Keeps trained tokens per second up while the fleet degrades (see the module doc)."""

    def __init__(self, knobs: ControlSection, engines: list[str],
                 emit: Callable[[Action], None], *, sandbox_deadline_s: float,
                 judge_deadline_s: float, hedging: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.knobs = knobs
        self.emit_action = emit
        self.clock = clock
        self.engines = {path: EngineState() for path in engines}
        self.avoided: frozenset[str] = frozenset()
        self.restarter: EngineRestarter | None = None
        self.hedging = hedging and knobs.hedge.enabled
        self.turn_latencies: deque[float] = deque(maxlen=256)
        self._new_latencies = 0
        self._hedge_after: float | None = None
        self.awaited: tuple[int, int] | None = None    # (step, rollouts) the loop waits on
        self.finished: dict[int, int] = {}
        self.hedges: dict[int, int] = {}
        self.actions: list[Action] = []
        self.sandbox = CallLimits("sandbox", knobs.sandbox, sandbox_deadline_s, self.emit)
        self.judge = CallLimits("judge", knobs.judge, judge_deadline_s, self.emit)
        self._task: asyncio.Task[None] | None = None
        self._restarts: set[asyncio.Task[None]] = set()

    def emit(self, action: Action) -> None:
        self.actions.append(action)
        log.info("control: %s %s: %s", action.kind, action.target, action.reason)
        try:
            self.emit_action(action)
        except Exception:
            log.exception("control: emitting %s failed", action.kind)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Judge engine health every :data:`TICK_S` on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._ticks(), name="control")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("control: tick failed")

    async def tick(self) -> None:
        """Decide on the engines and apply: routing at once, restarts in the background."""
        headroom = self.restarter.headroom() if self.restarter is not None else 0
        now = self.clock()
        knobs = self.knobs.engine
        for action in engine_actions(self.engines, now, knobs, restart_headroom=headroom):
            state = self.engines[action.target]
            if action.kind == "route_away":
                state.avoided_since = now
                state.slow_since = state.slow_since if state.slow_since is not None else now
                state.retry_s = (knobs.retry_s if not state.on_trial
                                 else min(knobs.retry_max_s, 2 * state.retry_s))
                state.on_trial = False
                state.slow_ticks = 0
                self.avoided = self.avoided | {action.target}
            elif action.kind == "trial":
                state.avoided_since = None
                state.on_trial = True
                state.rates.clear()   # judged afresh, at the same load as its peers
                self.avoided = self.avoided - {action.target}
            elif action.kind == "healthy":
                state.on_trial = False
                state.slow_since = None
            elif action.kind == "restart":
                if self.restarter is None:
                    continue
                state.restarting = True
                self.avoided = self.avoided | {action.target}   # drained: no new rollouts
                task = asyncio.get_running_loop().create_task(
                    self._restart(action), name=f"control-restart:{action.target}")
                self._restarts.add(task)   # the loop keeps only weak references to tasks
                task.add_done_callback(self._restarts.discard)
            self.emit(action)

    async def _restart(self, action: Action) -> None:
        """Drain ``action.target`` (routed away; wait for its rollouts to finish or move,
        up to ``drain_timeout_s``), restart it through its supervisor, then serve it again
        with a clean record."""
        assert self.restarter is not None
        path, state = action.target, self.engines[action.target]
        try:
            give_up = self.clock() + self.knobs.engine.drain_timeout_s
            while self.restarter.load(path) > 0 and self.clock() < give_up:
                await asyncio.sleep(0.2)
            await self.restarter.restart(path, action.reason)
        except Exception as exc:  # noqa: BLE001 - the engine's supervisor decides from here
            log.warning("control: restart of %s failed: %s: %s", path, type(exc).__name__, exc)
        finally:
            state.rates.clear()
            state.failures.clear()
            state.avoided_since = state.slow_since = None
            state.on_trial = False
            state.slow_ticks = 0
            state.restarting = False
            self.avoided = self.avoided - {path}

    # ------------------------------------------------------------- engine routing
    def pick(self, loads: dict[str, int]) -> str:
        """The engine the next rollout goes to, among ``loads`` (see policy.pick_engine)."""
        return pick_engine(loads, self.avoided & set(loads))

    def stream_finished(self, engine: str, tokens: int, seconds: float) -> None:
        state = self.engines.get(engine)
        if state is not None and tokens > 0 and seconds > 0:
            state.rates.append(tokens / seconds)
            del state.rates[:-self.knobs.engine.window]

    def stream_cut(self, engine: str, tokens: int, seconds: float) -> None:
        """A stream cancelled because the other copy of its hedged turn finished first: its
        rate so far (0 for an engine that sent nothing) is a sample like a finished one's."""
        state = self.engines.get(engine)
        if state is not None and seconds >= 0.05:
            state.rates.append(tokens / seconds)
            del state.rates[:-self.knobs.engine.window]

    def stream_failed(self, engine: str) -> None:
        """A live engine failed a stream.  The streams of one failed call fail together:
        they count once per second."""
        state = self.engines.get(engine)
        now = self.clock()
        if state is not None and (not state.failures or now - state.failures[-1] >= 1.0):
            state.failures.append(now)
            del state.failures[:-4 * self.knobs.engine.max_failures]

    # ------------------------------------------------------------------ hedging
    def awaiting(self, step: int, rollouts: int) -> None:
        """The coordinator now waits on ``step``'s ``rollouts``."""
        self.awaited = (step, rollouts)
        for old in [s for s in self.finished if s < step]:
            self.finished.pop(old, None)
            self.hedges.pop(old, None)

    def rollout_finished(self, step: int) -> None:
        self.finished[step] = self.finished.get(step, 0) + 1

    def turn_latency(self, seconds: float) -> None:
        self.turn_latencies.append(seconds)
        self._new_latencies += 1

    def hedge_after(self) -> float | None:
        """Seconds after which a turn may be hedged (None: not yet, or hedging is off).
        Every turn asks; the percentile is recomputed after each 32 new latencies."""
        if not self.hedging:
            return None
        if self._new_latencies >= 32 or self._hedge_after is None:
            self._new_latencies = 0
            self._hedge_after = hedge_after(list(self.turn_latencies), self.knobs.hedge)
        return self._hedge_after

    def hedge_due(self, rollout_id: str, step: int, running_s: float) -> bool:
        """Whether a turn of ``step`` running for ``running_s`` should be hedged now (and
        if so, counts the hedge and tells it)."""
        after = self.hedge_after()
        if after is None or running_s < after or self.awaited is None \
                or self.awaited[0] != step:
            return False
        total = self.awaited[1]
        unfinished = total - self.finished.get(step, 0)
        if not may_hedge(unfinished, total, self.hedges.get(step, 0), self.knobs.hedge):
            return False
        self.hedges[step] = self.hedges.get(step, 0) + 1
        self.emit(Action("hedge", rollout_id, f"turn running {running_s:.2f} s > "
                         f"{after:.2f} s (p{self.knobs.hedge.percentile * 100:g} x "
                         f"{self.knobs.hedge.factor:g}); {unfinished} of {total} rollouts of "
                         f"step {step} unfinished", running_s))
        return True

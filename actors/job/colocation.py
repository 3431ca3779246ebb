"""The colocated engines' memory hand-off around each learner step (``placement.colocate``;
docs/scaling.md, "Colocated placement").

With colocation the rollout coordinator runs generation and training in turn, never side by
side, because an engine and a learner rank share a device:

    generate (engines awake) -> release: every engine sleeps -> train step
    -> reclaim weights -> refit (publish) -> reclaim the KV cache -> next step

:class:`Colocation` makes those calls, every engine at once, each under its own deadline
(``placement.sleep_timeout_s``, ``wake_timeout_s``).  It never raises and never waits past a
deadline: an engine that is gone, restarting, refuses or does not answer in time is logged
and left to its own supervisor (a dead engine is restarted alone, awake, and loads the
current weights before it serves, as after any restart), and the learner's step goes ahead.
The learner's domain is never touched from here.  Without colocation the coordinator holds
:data:`NO_COLOCATION`, whose calls do nothing, so the loop reads the same either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.exceptions import RayTaskError

from erlay.actors.config import JobConfig
from erlay.actors.job.domains import ENGINE_GONE
from erlay.supervisor.deadline import within
from erlay.supervisor.tree import ChildRef

log = logging.getLogger("erlay.rollout")


class NoColocation:
    """The engines keep their memory; generation may run ahead of training."""

    def lookahead(self, max_staleness: int) -> int:
        """Steps generated ahead of the one training: the staleness bound allows it."""
        return max_staleness

    async def release(self) -> None:
        """Nothing to free."""

    async def reclaim_weights(self) -> None:
        """Nothing to take back."""

    async def reclaim_cache(self) -> None:
        """Nothing to take back."""

    def step_stats(self) -> dict[str, Any]:
        """No colocation figures."""
        return {}


NO_COLOCATION = NoColocation()


class Colocation(NoColocation):
    """Sleeps and wakes the colocated engines; see the module docstring for the contract.

    ``step_stats`` returns, and starts afresh, the figures of the calls since the last
    step, in its ``metrics.jsonl`` record: ``colocation_slept`` / ``colocation_woken``
    (engines whose sleep, and whose wake-up of the KV cache, succeeded),
    ``colocation_misses`` (calls that failed or passed their deadline), and the seconds the
    learner's timeline spent on them (``colocation_sleep_s``, ``colocation_wake_s``)."""

    def __init__(self, engines: list[ChildRef], *, level: int, sleep_timeout_s: float,
                 wake_timeout_s: float) -> None:
        self.engines = engines
        self.level = level
        self.sleep_timeout_s = sleep_timeout_s
        self.wake_timeout_s = wake_timeout_s
        self.asleep = False   # between a release and the reclaim of the cache
        self._stats = self._fresh()

    @staticmethod
    def _fresh() -> dict[str, Any]:
        return {"colocation_slept": 0, "colocation_woken": 0, "colocation_misses": 0,
                "colocation_sleep_s": 0.0, "colocation_wake_s": 0.0}

    def lookahead(self, max_staleness: int) -> int:
        """0: the engines must be asleep while the learner steps, so nothing generates then."""
        return 0

    async def release(self) -> None:
        """Every engine sleeps (its KV cache freed; at vLLM level 1 or 2 its weights too)."""
        done = await self._each("sleep", self.level, self.sleep_timeout_s, "colocation_sleep_s")
        self._stats["colocation_slept"] += done
        self.asleep = True

    async def reclaim_weights(self) -> None:
        """Every engine takes its weights' memory back, for the refit to load into."""
        await self._each("wake_up", ["weights"], self.wake_timeout_s, "colocation_wake_s")

    async def reclaim_cache(self) -> None:
        """Every engine takes its KV cache back and serves again."""
        done = await self._each("wake_up", ["kv_cache"], self.wake_timeout_s, "colocation_wake_s")
        self._stats["colocation_woken"] += done
        self.asleep = False

    def step_stats(self) -> dict[str, Any]:
        stats, self._stats = self._stats, self._fresh()
        return {**stats, "colocation_sleep_s": round(stats["colocation_sleep_s"], 4),
                "colocation_wake_s": round(stats["colocation_wake_s"], 4)}

    async def _each(self, method: str, arg: Any, timeout_s: float, clock: str) -> int:
        """``method(arg)`` on every engine at once; how many succeeded."""
        began = time.monotonic()
        results = await asyncio.gather(*(self._one(ref, method, arg, timeout_s)
                                         for ref in self.engines))
        self._stats[clock] += time.monotonic() - began
        self._stats["colocation_misses"] += results.count(False)
        return results.count(True)

    @staticmethod
    async def _one(ref: ChildRef, method: str, arg: Any, timeout_s: float) -> bool:
        try:
            await within(getattr(ref.actor, method).remote(arg), timeout_s,
                         f"{ref.path}.{method}")
            return True
        except (*ENGINE_GONE, RayTaskError) as exc:
            # Gone, restarting, refusing, or past its deadline: its supervisor decides (a
            # restart comes back awake and is admitted with the current weights).
            log.warning("colocated engine %s: %s(%s) failed, going on without it: %s",
                        ref.path, method, arg, f"{type(exc).__name__}: {exc}"[:300])
            return False


def colocation_for(cfg: JobConfig, engines: list[ChildRef]) -> NoColocation:
    """The coordinator's hand-off for ``cfg``: :class:`Colocation` when colocated."""
    placement = cfg.placement
    if not placement.colocate:
        return NO_COLOCATION
    return Colocation(engines, level=placement.sleep_level,
                      sleep_timeout_s=placement.sleep_timeout_s,
                      wake_timeout_s=placement.wake_timeout_s)

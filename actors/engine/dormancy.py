"""An engine's sleep state, for colocated placement (docs/scaling.md, "Colocated placement").

A colocated engine shares its device with a learner rank, and gives the memory it decodes
with back for the rank's train step: :meth:`EngineProtocol.sleep` before the step,
:meth:`EngineProtocol.wake_up` after the refit.  :class:`Dormancy` is the part both engines
share, with no Ray, no torch and no vLLM in it: whether the engine is asleep, the counters
``EngineStats`` reports, the refusal of new requests while asleep, and the sleep calls
waiting for the engine's own loop to have let go of the memory.

Why refuse, not queue: a request queued in a sleeping engine waits an unknown time (until
the learner's step and the refit are done) while its caller's stream deadline runs; refused
at once with :class:`~erlay.actors.engine.api.EngineAsleep`, it is asked again later or
elsewhere by the rollout side, as any refusal is.  Requests the engine already held when
it fell asleep are its own commitment and are kept.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from erlay.actors.engine.api import EngineAsleep

TAGS = ("weights", "kv_cache")
"""What a wake-up can bring back, in vLLM's names; ``None`` means both."""


def wake_tags(tags: list[str] | None) -> frozenset[str]:
    """The set ``tags`` names (``None``: every tag); a ValueError for an unknown one.

    >>> sorted(wake_tags(None))
    ['kv_cache', 'weights']
    >>> sorted(wake_tags(["weights"]))
    ['weights']
    """
    if tags is None:
        return frozenset(TAGS)
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise ValueError(f"wake_up tags {unknown} are not among {list(TAGS)}")
    return frozenset(tags)


class Dormancy:
    """Whether an engine is asleep, and who waits for its sleep to take effect.

    Contract: :meth:`fall_asleep` marks the engine asleep at once (so :meth:`refuse` turns
    new requests away from then on) and returns a future that the engine's own loop resolves
    with :meth:`released`, once it holds no KV cache; :meth:`wake` marks it awake again.
    Both are idempotent and count only real transitions.  Not thread-safe: the engine's
    event loop owns it.

    >>> d = Dormancy()
    >>> d.refuse("r1")
    >>> d.wake(frozenset(TAGS))
    False
    """

    def __init__(self) -> None:
        self.asleep = False
        self.level = 0
        self.sleeps = 0
        self.wakes = 0
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def due(self) -> bool:
        """A sleep call waits for the loop to release the memory."""
        return bool(self._waiters)

    def fall_asleep(self, level: int) -> asyncio.Future[None]:
        """Asleep from now on; the returned future is resolved by :meth:`released`."""
        if not self.asleep:
            self.asleep, self.level = True, level
            self.sleeps += 1
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    def released(self) -> None:
        """The engine's loop has let go of its memory: answer every waiting sleep call."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def wake(self, tags: frozenset[str]) -> bool:
        """Awake again if ``tags`` bring the KV cache back; True when that changed it."""
        if not self.asleep or "kv_cache" not in tags:
            return False
        self.asleep, self.level = False, 0
        self.wakes += 1
        return True

    def refuse(self, request_id: str) -> None:
        """Raise :class:`EngineAsleep` for a new request while asleep."""
        if self.asleep:
            raise EngineAsleep(f"request {request_id}: the engine is asleep (its memory is "
                               "lent to a colocated learner step); ask again after it wakes")

    def fail(self, exc: BaseException) -> None:
        """The engine failed: every waiting sleep call fails with it."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(exc)

    def report(self, **extra: Any) -> dict[str, Any]:
        """What ``sleep`` and ``wake_up`` return: the state, the counters, ``extra``."""
        return {"asleep": self.asleep, "level": self.level, "sleeps": self.sleeps,
                "wakes": self.wakes, **extra}


def free_device_cache(on_cuda: bool) -> None:
    """Collect the dropped tensors and, on CUDA, hand the caching allocator's free blocks
    back to the driver (``torch.cuda.empty_cache``): freed tensors stay reserved by this
    process otherwise, and the colocated learner, another process, could not use them."""
    gc.collect()
    if on_cuda:
        import torch
        torch.cuda.empty_cache()

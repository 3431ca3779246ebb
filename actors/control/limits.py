"""Adaptive limits for the calls into one domain (the sandbox, the judge).

:class:`CallLimits` is what a domain client asks before and tells after each call: the
deadline to give the call (:func:`~erlay.actors.control.policy.adaptive_deadline`), and a
slot under each host's concurrency limit (:func:`~erlay.actors.control.policy.aimd`).  A
change worth telling (the deadline moved by a tenth, the limit crossed a whole number) is an
:class:`~erlay.actors.control.policy.Action` handed to ``emit``.

Contracts: a slot is always released (``async with``); a waiter for a slot waits only while
some call holds one, so it never waits forever; with ``knobs.enabled`` false every call gets
the configured deadline and no limit.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from erlay.actors.config.control import CallControl
from erlay.actors.control.policy import Action, adaptive_deadline, aimd

TELL_EVERY_S = 10.0


class _HostLimit:
    """One host's AIMD limit, the calls holding its slots, and those waiting for one (woken
    one at a time, first come first served)."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.told = int(limit)   # the limit last emitted, and when
        self.told_at = -TELL_EVERY_S
        self.in_flight = 0
        self.waiting: deque[asyncio.Future[None]] = deque()

    def wake(self) -> None:
        while self.waiting and self.in_flight < int(self.limit):
            waiter = self.waiting.popleft()
            if not waiter.done():
                self.in_flight += 1   # handed over: the waiter holds it when it wakes
                waiter.set_result(None)


class CallLimits:
    """The adaptive deadline and per-host concurrency of one domain's calls."""

    def __init__(self, domain: str, knobs: CallControl, configured_s: float,
                 emit: Callable[[Action], None] | None = None) -> None:
        self.domain = domain
        self.knobs = knobs
        self.configured_s = configured_s
        self.emit = emit or (lambda action: None)
        self.latencies: deque[float] = deque(maxlen=knobs.window)
        self.timeouts = 0
        self._hosts: dict[str, _HostLimit] = {}
        self._told_deadline = configured_s
        self._told_deadline_at = -TELL_EVERY_S
        self._deadline: float | None = None   # cached until the next latency

    def deadline(self) -> float:
        """The deadline of the next call (the configured one while adapting is off).
        Every call asks; the percentile is recomputed when a call has ended since."""
        if not self.knobs.enabled:
            return self.configured_s
        if self._deadline is None:
            self._deadline = adaptive_deadline(list(self.latencies), self.knobs,
                                               self.configured_s)
        return self._deadline

    def limit(self, host: str) -> float:
        entry = self._hosts.get(host)
        return entry.limit if entry is not None else float(self.knobs.max_concurrency)

    @asynccontextmanager
    async def slot(self, host: str) -> AsyncIterator[None]:
        """Hold one of ``host``'s slots for the call made inside; wait for one while the
        host's limit is reached (never while nothing holds one, so never forever)."""
        if not self.knobs.enabled:
            yield
            return
        entry = self._hosts.get(host)
        if entry is None:
            entry = self._hosts[host] = _HostLimit(float(self.knobs.max_concurrency))
        if entry.in_flight < max(1, int(entry.limit)) and not entry.waiting:
            entry.in_flight += 1
        else:
            waiter = asyncio.get_running_loop().create_future()
            entry.waiting.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    entry.in_flight -= 1   # it was handed a slot it will not use
                    entry.wake()
                raise
        try:
            yield
        finally:
            entry.in_flight -= 1
            entry.wake()

    def record(self, host: str, seconds: float, *, timed_out: bool,
               congested: bool = False) -> None:
        """One call ended: ``seconds`` the callee ran it, whether it hit its deadline (the
        user's code was too slow: its time is the deadline, not its own, so it does not
        feed the latencies), and whether the host was ``congested`` (the call waited at the
        host longer than a call may run, or the host lost it).  Only congestion lowers the
        host's concurrency: a hung tool is its code's fault, not the host's load."""
        if not self.knobs.enabled:
            return
        if timed_out:
            self.timeouts += 1
        else:
            self.latencies.append(seconds)
            self._deadline = None
        entry = self._hosts.setdefault(host, _HostLimit(float(self.knobs.max_concurrency)))
        entry.limit = aimd(entry.limit, congested, self.knobs)
        # Told when it has halved or doubled since last told, at most once per TELL_EVERY_S
        # a host: AIMD saws up and down by design, and each tooth is not news.
        now = time.monotonic()
        if not entry.told / 2 < int(entry.limit) < entry.told * 2 \
                and now - entry.told_at >= TELL_EVERY_S:
            entry.told, entry.told_at = int(entry.limit), now
            self.emit(Action(f"{self.domain}_concurrency", host,
                             ("the host is congested" if congested else
                              "the host keeps up"), float(entry.told)))
        deadline = self.deadline()
        if abs(deadline - self._told_deadline) > 0.1 * self._told_deadline \
                and now - self._told_deadline_at >= TELL_EVERY_S:
            self._told_deadline_at = now
            self.emit(Action(f"{self.domain}_deadline", self.domain,
                             f"p{self.knobs.deadline_percentile * 100:g} of the last "
                             f"{len(self.latencies)} calls x{self.knobs.deadline_multiplier:g}, "
                             f"between {self.knobs.deadline_floor_s:g} and "
                             f"{self.configured_s:g} s", deadline))
            self._told_deadline = deadline

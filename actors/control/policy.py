"""The goodput controller's decisions: pure functions of (state, observations) -> actions.

Nothing here reads a clock, a socket or a global: the caller passes ``now`` and what it
observed, and gets back :class:`Action` s (each with the reason a user reads in
``events.jsonl``) or a number (a deadline, a concurrency limit).
:mod:`erlay.actors.control.controller` keeps the state and applies the actions.

Engine health, in one picture: an engine's *rate* is the median of its recent finished
streams' decode rates (tokens / seconds from dispatch to the last chunk).  Rates are compared
only while the engines share the rollouts evenly (least loaded), since a request's rate falls
with its engine's load.  Against the median of its peers' rates:

- below ``slow_ratio`` of it at ``slow_ticks`` judgements in a row -> ``route_away`` (new
  rollouts go to the others);
- routed away for ``retry_s`` (doubled after each failed trial, up to ``retry_max_s``) ->
  ``trial``: it gets its even share again and is judged afresh under the same load as its
  peers; back above ``recover_ratio`` -> ``healthy`` (the retry interval resets), still slow
  -> ``route_away`` again;
- ``max_failures`` stream failures in ``failure_window_s``, or slow for ``restart_after_s``
  -> ``restart`` (drained first), only while the generation domain's restart intensity has
  headroom.

The fastest engine is never routed away, so routing can never leave the job without one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from erlay.actors.config.control import CallControl, EngineControl, HedgeControl


@dataclass(frozen=True)
class Action:
    """One decision: ``kind`` on ``target``, and why.  ``value`` is the new number for the
    limit kinds (``sandbox_deadline``, ``judge_deadline``, ``sandbox_concurrency``, ...)."""

    kind: str
    target: str
    reason: str
    value: float | None = None

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"kind": self.kind, "target": self.target,
                                  "reason": self.reason}
        if self.value is not None:
            out["value"] = round(self.value, 4)
        return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0 < q < 1) by linear interpolation; None for no values.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5)
    2.5
    >>> percentile([], 0.9) is None
    True
    """
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ----------------------------------------------------------------------- engine health
@dataclass
class EngineState:
    """What the controller remembers of one engine (by tree path)."""

    rates: list[float] = field(default_factory=list)   # tokens/s of recent finished streams
    failures: list[float] = field(default_factory=list)   # when its streams failed
    slow_ticks: int = 0               # judgements in a row below slow_ratio
    avoided_since: float | None = None   # routed away since (None: serving)
    slow_since: float | None = None   # first routed away, through failed trials
    on_trial: bool = False            # serving again, to be judged afresh
    retry_s: float = 0.0              # the current wait before a trial (0: not yet set)
    restarting: bool = False


def engine_rate(state: EngineState, knobs: EngineControl) -> float | None:
    """The engine's rate: the median of its last ``window`` streams, once it has
    ``min_samples`` of them."""
    recent = state.rates[-knobs.window:]
    if len(recent) < knobs.min_samples:
        return None
    return percentile(recent, 0.5)


def engine_actions(engines: Mapping[str, EngineState], now: float, knobs: EngineControl, *,
                   restart_headroom: int) -> list[Action]:
    """The routing and restart decisions for ``engines`` at ``now``: actions ``route_away``,
    ``trial``, ``healthy`` and ``restart``.  Pure but for one thing: it counts each engine's
    ``slow_ticks`` (the judgement's memory).

    ``restart_headroom``: restarts the generation domain may still take within its
    intensity; the controller restarts only while it exceeds ``knobs.intensity_headroom``.

    >>> k = EngineControl(min_samples=2, slow_ticks=1)
    >>> fast, slow = EngineState(rates=[100.0, 110.0]), EngineState(rates=[20.0, 25.0])
    >>> [(a.kind, a.target) for a in engine_actions({"e0": fast, "e1": slow}, 0.0, k,
    ...                                             restart_headroom=3)]
    [('route_away', 'e1')]
    """
    rates = {path: engine_rate(s, knobs) for path, s in engines.items()
             if s.avoided_since is None and not s.restarting}
    actions: list[Action] = []
    fastest = max((p for p, r in rates.items() if r is not None), key=lambda p: rates[p] or 0.0,
                  default=None)
    budget = restart_headroom - knobs.intensity_headroom
    budget -= sum(s.restarting for s in engines.values())
    for path, state in engines.items():
        if state.restarting:
            continue
        recent_failures = [t for t in state.failures if t >= now - knobs.failure_window_s]
        if len(recent_failures) >= knobs.max_failures and budget > 0:
            budget -= 1
            actions.append(Action("restart", path, f"{len(recent_failures)} stream failures "
                                  f"in {knobs.failure_window_s:g} s"))
            continue
        if state.avoided_since is not None:
            if state.slow_since is not None and now - state.slow_since >= knobs.restart_after_s \
                    and budget > 0:
                budget -= 1
                actions.append(Action("restart", path, f"slow for {now - state.slow_since:.0f} "
                                      "s, through every trial"))
            elif now - state.avoided_since >= state.retry_s:
                actions.append(Action("trial", path, f"routed away {now - state.avoided_since:.0f}"
                                      " s ago: its even share again, judged afresh"))
            continue
        rate = rates.get(path)
        peers = [r for p, r in rates.items() if p != path and r is not None]
        peer = percentile(peers, 0.5) or 0.0
        if rate is None or peer <= 0:
            continue
        share = rate / peer
        if share < knobs.slow_ratio and path != fastest:
            state.slow_ticks += 1
            if state.slow_ticks >= knobs.slow_ticks or state.on_trial:
                actions.append(Action("route_away", path, f"{rate:.1f} tokens/s per request, "
                                      f"{share:.2f} of its peers' {peer:.1f}"
                                      + (" (failed its trial)" if state.on_trial else "")))
        else:
            state.slow_ticks = 0
            if state.on_trial and share >= knobs.recover_ratio:
                actions.append(Action("healthy", path, f"passed its trial: {rate:.1f} tokens/s "
                                      f"per request, {share:.2f} of its peers' {peer:.1f}"))
    return actions


def pick_engine(loads: Mapping[str, int], avoided: frozenset[str]) -> str:
    """Which engine of ``loads`` (path -> rollouts in flight, the candidates) gets the next
    rollout: the least loaded of those not routed away; the least loaded of all when every
    one is.

    >>> pick_engine({"e0": 5, "e1": 0}, frozenset({"e1"}))
    'e0'
    >>> pick_engine({"e0": 5, "e1": 0}, frozenset({"e0", "e1"}))
    'e1'
    """
    pool = [p for p in loads if p not in avoided] or list(loads)
    return min(pool, key=lambda p: loads[p])


# ------------------------------------------------------------------------------ hedging
def hedge_after(latencies: Sequence[float], knobs: HedgeControl) -> float | None:
    """Seconds after which a running turn is a straggler: ``factor`` times the
    ``percentile`` of recent turn latencies, at least ``floor_s``; None until there are
    ``min_samples`` of them."""
    if len(latencies) < knobs.min_samples:
        return None
    p = percentile(latencies, knobs.percentile) or 0.0
    return max(knobs.floor_s, p * knobs.factor)


def may_hedge(unfinished: int, total: int, hedged: int, knobs: HedgeControl) -> bool:
    """Whether the awaited step may start another hedge: its unfinished rollouts are its
    tail (at most ``tail_fraction`` of them) and its hedge budget is not spent.

    >>> may_hedge(3, 64, 0, HedgeControl())
    True
    >>> may_hedge(40, 64, 0, HedgeControl())
    False
    """
    return 0 < unfinished <= max(1, int(total * knobs.tail_fraction)) \
        and hedged < knobs.max_per_step


# --------------------------------------------------------------------- adaptive limits
def adaptive_deadline(latencies: Sequence[float], knobs: CallControl,
                      configured_s: float) -> float:
    """A call's deadline: ``deadline_multiplier`` times the ``deadline_percentile`` of
    recent latencies, between ``deadline_floor_s`` and the ``configured_s`` maximum; the
    configured one until ``min_samples`` calls completed.

    >>> k = CallControl(min_samples=3, deadline_floor_s=0.5)
    >>> adaptive_deadline([0.1, 0.1, 0.1], k, 5.0)
    0.5
    >>> adaptive_deadline([1.0, 1.0, 2.0], k, 5.0)
    5.0
    >>> adaptive_deadline([0.1], k, 5.0)
    5.0
    """
    if len(latencies) < knobs.min_samples:
        return configured_s
    p = percentile(latencies, knobs.deadline_percentile) or 0.0
    return min(configured_s, max(knobs.deadline_floor_s, p * knobs.deadline_multiplier))


def aimd(limit: float, timed_out: bool, knobs: CallControl) -> float:
    """The concurrency limit after one call: additive increase (``increase / limit``, so
    one per round of calls) when it met its deadline, multiplicative decrease when it hit
    it; within [``min_concurrency``, ``max_concurrency``].

    >>> k = CallControl(max_concurrency=8)
    >>> aimd(4.0, True, k)
    2.0
    >>> aimd(4.0, False, k)
    4.25
    """
    new = limit * knobs.decrease if timed_out else limit + knobs.increase / max(limit, 1.0)
    return min(float(knobs.max_concurrency), max(float(knobs.min_concurrency), new))

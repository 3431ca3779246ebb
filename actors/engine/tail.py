"""The long tail of a generation batch: how long requests run, and how busy the engine is
while the last of them finish.

In asynchronous RL a step waits for its slowest rollouts.  Most requests of a batch finish
early; the few long ones then decode at low concurrency, where each decode step does little
work.  That is where speculative decoding pays, so the engine reports the tail per window
(one per RL step when the job asks at each step) and speculates only below a concurrency
threshold.  Pure bookkeeping: no torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TAIL_FRACTION = 0.25   # a step is in the tail when at most this share of the peak is running


def percentile(values: list[int], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))])


@dataclass
class TailWindow:
    """Decode steps and finished requests since the window opened.

    ``drafted0``/``accepted0`` are the engine's cumulative draft counters when it opened, so
    the report's acceptance covers this window only.
    """

    drafted0: int = 0
    accepted0: int = 0
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # (running, tokens, k)
    lengths: list[int] = field(default_factory=list)                 # tokens per request

    def step(self, running: int, tokens: int, k: int) -> None:
        self.steps.append((running, tokens, k))

    def finished(self, generated: int) -> None:
        self.lengths.append(generated)

    def report(self, *, drafted: int = 0, accepted: int = 0) -> dict[str, Any]:
        """The window's figures: request lengths (p50, p90, max), decode steps, the peak
        concurrency, the tail (steps at or below ``TAIL_FRACTION`` of the peak: their count,
        share, mean concurrency and tokens), speculative steps and draft acceptance."""
        peak = max((r for r, _, _ in self.steps), default=0)
        limit = max(1.0, TAIL_FRACTION * peak)
        tail = [(r, t) for r, t, _ in self.steps if r <= limit]
        drafted, accepted = drafted - self.drafted0, accepted - self.accepted0
        return {
            "requests": len(self.lengths),
            "length_p50": percentile(self.lengths, 0.5),
            "length_p90": percentile(self.lengths, 0.9),
            "length_max": max(self.lengths, default=None),
            "steps": len(self.steps),
            "peak_concurrency": peak,
            "tail_steps": len(tail),
            "tail_step_share": round(len(tail) / len(self.steps), 4) if self.steps else None,
            "tail_concurrency_mean": round(sum(r for r, _ in tail) / len(tail), 3)
            if tail else None,
            "tail_tokens": sum(t for _, t in tail),
            "spec_steps": sum(1 for _, _, k in self.steps if k),
            "drafted": drafted,
            "acceptance": round(accepted / drafted, 4) if drafted else None,
        }

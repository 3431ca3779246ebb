"""The rollout id: one type that writes and reads ``r{step:05d}-g{group:03d}-{k}``.

The coordinator names every training rollout this way (step ``step``'s group ``group``,
sample ``k`` of the group); the journal, the learner's ledger and the chaos invariants key
everything by it, and the invariants read the step back out of it (a rollout belongs to the
step its id names).  Validation rollouts are named ``v...`` and are never parsed as training
ones.  Pure; no I/O.

    >>> RolloutId(42, 3, 1).format()
    'r00042-g003-1'
    >>> RolloutId.parse('r00042-g003-1')
    RolloutId(step=42, group=3, k=1)
    >>> RolloutId.parse('v00001-0002') is None
    True
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_FORMAT = re.compile(r"^r(\d{5,})-g(\d{3,})-(\d+)$")


@dataclass(frozen=True, order=True)
class RolloutId:
    """Step ``step``, group ``group``, sample ``k``: all >= 0."""

    step: int
    group: int
    k: int

    def __post_init__(self) -> None:
        if min(self.step, self.group, self.k) < 0:
            raise ValueError(f"a rollout id's parts are >= 0, got {self!r}")

    def format(self) -> str:
        """The id as journaled: ``r{step:05d}-g{group:03d}-{k}``."""
        return f"r{self.step:05d}-g{self.group:03d}-{self.k}"

    @staticmethod
    def parse(text: str) -> RolloutId | None:
        """The id ``text`` names, or None when it is not a training rollout's id."""
        m = _FORMAT.match(text)
        return RolloutId(int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def step_of(rollout_id: str) -> int | None:
    """The learner step a rollout id was made for (``r00042-g003-1`` -> 42), or None."""
    parsed = RolloutId.parse(rollout_id)
    return None if parsed is None else parsed.step

"""DAPO's dynamic sampling (Yu et al. 2025, eq. 11): a step trains only on groups with a
learning signal.  A group whose valid rewards are all equal (every answer right, or every
one wrong) has zero advantage under any group baseline; it is dropped, and the step is
refilled with new groups (rounds sized by :func:`refill_size`) until it has
``prompts_per_step`` informative ones, or
``max_fill_rounds`` rounds have run, or the step has played its refill budget
(``fill_budget x prompts_per_step`` groups beyond its own).  The budget bounds what a step
may cost: on an easy task most groups are all right, and refilling until full would
multiply generation.

Contracts:

- **Nothing is lost.**  A dropped group's rollouts are still consumed by their step, with
  weight 0: they go to the learner with every token masked (the ledger records them as
  masked) and their CONSUMED transitions say ``"filtered": true``.  They are counted apart
  (``filtered`` in the step's counts, beside stale and failed samples).
- **Replay-stable.**  Refill group ``j`` of step ``n`` is group ``prompts_per_step + j``
  (``RolloutId(n, prompts_per_step + j, k)``) and plays episode
  :func:`fill_episode` ``(n, j)``, a stream of its own beyond any step's episodes, so a
  dataset row's position in the regular order never depends on how many groups were
  dropped.  A coordinator that restarts re-makes the same decisions from the journaled
  rewards; and any group of the step the journal already holds is played again and fed,
  whatever the successor decides, so no dispatched rollout is left unconsumed.

Pure decisions (:func:`informative`, :func:`fill_episode`) and one async driver,
:func:`play_with_refills`, which takes the group player as a function.

May import: erlay.actors.job.rollout, erlay.actors.job.structured.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

from erlay.actors.job.rollout import Trajectory
from erlay.actors.job.structured import all_or_none

# Refill episodes start here: far past any step's regular episodes (step n, group g plays
# n * prompts_per_step + g), and each step has FILL_STRIDE of them.
FILL_BASE = 1 << 40
FILL_STRIDE = 1 << 16

PlayGroup = Callable[[int, int, int], Awaitable[list[Trajectory]]]   # (step, group, episode)


def informative(group: Sequence[Trajectory]) -> bool:
    """Whether a group carries a learning signal: its valid members' rewards differ.  A
    group with fewer than two valid members has nothing to compare, so it has none."""
    rewards = [t.reward for t in group if t.valid]
    return len(rewards) > 1 and max(rewards) > min(rewards)


def fill_episode(step: int, j: int) -> int:
    """The episode index refill group ``j`` of ``step`` plays."""
    if not 0 <= j < FILL_STRIDE:
        raise ValueError(f"refill group {j} is outside 0..{FILL_STRIDE - 1}")
    return FILL_BASE + step * FILL_STRIDE + j


def refill_size(groups: int, informative_now: int, played: int, budget_left: int) -> int:
    """How many groups the next refill round plays: enough to fill the step at the share
    of informative groups seen so far in it (all that is left of the budget when none was
    informative), never more than ``budget_left``; 0 when the step is full.  One round sized
    to the expected need, rather than several of the bare shortfall, lets the engines batch
    the refill and spares the latency of the rounds it saves."""
    missing = groups - informative_now
    if missing <= 0 or budget_left <= 0:
        return 0
    if informative_now == 0:
        return budget_left
    return min(budget_left, math.ceil(missing * played / informative_now))


@dataclass(frozen=True)
class FilledStep:
    """A step's groups after dynamic sampling: every group played (regular, then refills,
    in group order), which of them were dropped, and the refill rounds run."""

    groups: list[list[Trajectory]]
    dropped: frozenset[int]      # indices into ``groups``
    rounds: int

    @property
    def informative(self) -> int:
        return len(self.groups) - len(self.dropped)


async def play_with_refills(play: PlayGroup, step: int, groups: int, max_rounds: int,
                            max_fill: int | None = None,
                            journaled: Collection[int] = ()) -> FilledStep:
    """Play step ``step``'s ``groups`` regular groups, then refill rounds while fewer than
    ``groups`` are informative, rounds remain and fewer than ``max_fill`` refill groups
    have been played (None: no bound); then any group in ``journaled`` (group indices the
    journal already holds for this step) not played yet.  Marks every group that is not
    informative as dropped, then returns (:class:`FilledStep`)."""
    played = list(await all_or_none(play(step, g, step * groups + g) for g in range(groups)))
    budget = FILL_STRIDE if max_fill is None else min(max_fill, FILL_STRIDE)
    rounds = 0
    while rounds < max_rounds:
        want = refill_size(groups, sum(informative(g) for g in played), len(played),
                           budget - (len(played) - groups))
        if want <= 0:
            break
        start = len(played)
        played += list(await all_or_none(
            play(step, start + j, fill_episode(step, start - groups + j))
            for j in range(want)))
        rounds += 1
    # Groups a predecessor dispatched past where this incarnation stopped: fed all the same.
    last = max((g for g in journaled if g >= len(played)), default=len(played) - 1)
    played += list(await all_or_none(play(step, g, fill_episode(step, g - groups))
                                     for g in range(len(played), last + 1)))
    dropped = frozenset(i for i, g in enumerate(played) if not informative(g))
    return FilledStep(played, dropped, rounds)

"""DAPO's dynamic sampling without Ray: which groups are dropped, how a step is refilled,
where refill episodes come from, and that a successor feeds every group its predecessor
dispatched.  The group player is a script of rewards."""

from __future__ import annotations

import asyncio

import pytest

from erlay.actors.job.dynamic_sampling import (
    FILL_BASE,
    fill_episode,
    informative,
    play_with_refills,
    refill_size,
)
from erlay.actors.job.rollout import Trajectory
from erlay.actors.journal.rollout_id import RolloutId


def group(step: int, g: int, rewards: list[float], valid: list[bool] | None = None
          ) -> list[Trajectory]:
    out = []
    for k, r in enumerate(rewards):
        t = Trajectory(RolloutId(step, g, k).format(), step, g, 0, [1], reward=r)
        if valid is not None and not valid[k]:
            t.judged_ok = False
        out.append(t)
    return out


class Script:
    """Plays group ``g`` with the rewards ``by_group[g]`` (all 0 past the script), and
    records every (group, episode) it was asked to play."""

    def __init__(self, by_group: dict[int, list[float]]) -> None:
        self.by_group = by_group
        self.played: list[tuple[int, int]] = []

    async def __call__(self, step: int, g: int, episode: int) -> list[Trajectory]:
        self.played.append((g, episode))
        return group(step, g, self.by_group.get(g, [0.0, 0.0]))


def test_a_group_is_informative_only_when_its_valid_rewards_differ() -> None:
    assert informative(group(0, 0, [1.0, 0.0]))
    assert not informative(group(0, 0, [1.0, 1.0]))
    assert not informative(group(0, 0, [0.0, 0.0]))
    # The unjudged sample's 0 is no reward: the valid ones are all 1.
    assert not informative(group(0, 0, [1.0, 0.0, 1.0], valid=[True, False, True]))
    assert not informative(group(0, 0, [1.0, 0.0], valid=[True, False]))


def test_dropped_groups_are_refilled_with_new_episodes_until_the_step_is_full() -> None:
    # Groups 0..3: two informative, so half are.  Short by two, round 1 plays four more
    # (groups 4..7); two of them are informative: four, done.
    script = Script({0: [1, 0], 1: [1, 1], 2: [0, 1], 3: [0, 0], 4: [1, 1], 5: [1, 0],
                     6: [0, 1]})
    filled = asyncio.run(play_with_refills(script, 7, 4, max_rounds=5))
    assert [g for g, _ in script.played] == list(range(8))
    assert filled.rounds == 1 and filled.informative == 4
    assert filled.dropped == {1, 3, 4, 7}
    episodes = dict(script.played)
    assert [episodes[g] for g in range(4)] == [28, 29, 30, 31]   # step 7's regular ones
    assert [episodes[g] for g in range(4, 8)] == [fill_episode(7, j) for j in range(4)]


def test_a_round_is_sized_to_what_the_step_still_needs() -> None:
    assert refill_size(32, 8, 32, 100) == 96     # a quarter informative: 24 / 0.25
    assert refill_size(32, 8, 32, 40) == 40      # ... within the budget
    assert refill_size(32, 0, 32, 40) == 40      # none yet: all the budget
    assert refill_size(32, 32, 40, 40) == 0      # full
    assert refill_size(32, 3, 32, 0) == 0        # no budget left


def test_a_step_still_short_after_its_rounds_trains_on_what_it_has() -> None:
    script = Script({0: [1, 0]})        # everything else all-zero
    filled = asyncio.run(play_with_refills(script, 0, 3, max_rounds=2, max_fill=10))
    assert filled.rounds == 2 and filled.informative == 1
    assert len(filled.groups) == 3 + 6 + 4 and len(filled.dropped) == 12


def test_the_refill_budget_bounds_what_a_step_plays() -> None:
    # Four regular groups, none informative; a budget of 3 refill groups over any rounds.
    script = Script({})
    filled = asyncio.run(play_with_refills(script, 0, 4, max_rounds=5, max_fill=3))
    assert len(filled.groups) == 4 + 3 and filled.rounds == 1
    # Half informative, short by two: round 1 would play four, the budget allows three.
    script = Script({0: [1, 0], 1: [1, 0]})
    filled = asyncio.run(play_with_refills(script, 0, 4, max_rounds=5, max_fill=3))
    assert len(filled.groups) == 4 + 3 and filled.rounds == 1


def test_no_rounds_means_no_refill() -> None:
    filled = asyncio.run(play_with_refills(Script({}), 0, 2, max_rounds=0))
    assert len(filled.groups) == 2 and filled.dropped == {0, 1} and filled.rounds == 0


def test_a_successor_feeds_every_group_its_predecessor_dispatched() -> None:
    # The predecessor got as far as group 5; this incarnation, all informative, would stop
    # at 3.  Groups 3..5 are in the journal, so they are played (from it) and fed.
    script = Script({g: [1, 0] for g in range(6)})
    filled = asyncio.run(play_with_refills(script, 0, 3, max_rounds=3,
                                           journaled={0, 1, 4, 5}))
    assert [g for g, _ in script.played] == [0, 1, 2, 3, 4, 5]
    assert len(filled.groups) == 6 and not filled.dropped


def test_refill_episodes_are_a_stream_of_their_own() -> None:
    assert fill_episode(0, 0) == FILL_BASE
    assert fill_episode(3, 2) - fill_episode(3, 0) == 2
    assert fill_episode(1, 0) > fill_episode(0, 9)
    with pytest.raises(ValueError):
        fill_episode(0, -1)

"""bench/learning.py's gen_train_overlap: the time during which generation and training both
ran, over the RL wall time, from the windows each RL step record carries."""

from __future__ import annotations

from typing import Any

import pytest

from bench.learning import both_s, covered_s, gen_train_overlap, union


def step(gen: tuple[float, float], train: tuple[float, float], step_s: float = 0.0
         ) -> dict[str, Any]:
    """An RL step record as the coordinator writes it (only the fields used here)."""
    return {"gen_window": list(gen), "train_window": list(train),
            "gen_s": gen[1] - gen[0], "train_s": train[1] - train[0], "step_s": step_s}


def old_formula(steps: list[dict[str, Any]]) -> float:
    """What the bench reported before issue 16: (gen + train seconds) / step seconds."""
    return sum(m["gen_s"] + m["train_s"] for m in steps) / sum(m["step_s"] for m in steps)


def test_union_merges_overlapping_and_touching_windows_and_drops_empty_ones() -> None:
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6), (9, 8)]) == [(0, 4), (5, 7)]
    assert covered_s([(0, 10), (2, 5), (9, 12)]) == 12


def test_both_counts_only_the_time_both_sides_are_open() -> None:
    assert both_s([(0, 4), (6, 10)], [(3, 7), (9, 20)]) == pytest.approx(1 + 1 + 1)
    assert both_s([(0, 1)], [(1, 2)]) == 0


def test_strictly_alternating_phases_overlap_zero() -> None:
    steps = [step((0, 4), (4, 5)), step((5, 9), (9, 10))]
    assert gen_train_overlap(steps) == {"gen_train_overlap": 0.0, "gen_busy": 0.8,
                                        "train_busy": 0.2}


def test_planted_double_count_two_generations_at_once_then_training_alone() -> None:
    # Steps 0 and 1 generate together in [0, 10]; training follows, alone, in [10, 12].
    # Step 0 waits 10 s for its rollouts and trains 1 s; step 1's are ready, it trains 1 s.
    steps = [step((0, 10), (10, 11), step_s=11), step((0, 10), (11, 12), step_s=1)]
    assert old_formula(steps) == pytest.approx(22 / 12)   # "almost always both": wrong
    figures = gen_train_overlap(steps)
    assert figures["gen_train_overlap"] == 0.0
    assert (figures["gen_busy"], figures["train_busy"]) == (round(10 / 12, 3),
                                                            round(2 / 12, 3))


def test_one_step_off_policy_overlaps_while_the_next_step_generates() -> None:
    # Each step's generation starts when the previous one's ends; training of step n runs
    # while step n+1 generates, except the last.
    steps = [step((0, 4), (4, 6)), step((4, 8), (8, 10)), step((8, 12), (12, 14))]
    assert gen_train_overlap(steps)["gen_train_overlap"] == round(4 / 14, 3)


def test_both_phases_open_the_whole_time_overlap_one() -> None:
    assert gen_train_overlap([step((0, 10), (0, 10))])["gen_train_overlap"] == 1.0


def test_steps_without_windows_are_left_out_and_none_at_all_gives_none() -> None:
    recovered = {"recovered": True, "gen_s": 0.0, "train_s": 0.0, "step_s": 0.0}
    steps = [step((0, 4), (4, 5)), recovered]
    assert gen_train_overlap(steps)["gen_train_overlap"] == 0.0
    assert gen_train_overlap([recovered]) == {"gen_train_overlap": None, "gen_busy": None,
                                              "train_busy": None}

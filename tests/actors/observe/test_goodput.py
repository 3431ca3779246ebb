"""Goodput's one definition: per-step counts by first reason, and tokens per second over
RL step records in which a re-fed step appears twice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from erlay.actors.observe.goodput import (
    NOT_TRAINED,
    StepCounts,
    goodput,
    not_trained,
    trained_tokens,
)


@dataclass
class FakeSample:
    judged_ok: bool = True
    user_error: dict[str, str] | None = None
    judge_kind: str = ""
    poison: int = 0
    filtered: bool = False


USER_ERROR = {"plugin": "p:Env", "method": "step", "kind": "exception"}


def rl(step: int, **fields: Any) -> dict[str, Any]:
    return {"phase": "rl", "step": step, **fields}


def test_counts_hold_the_identity_over_a_mixed_step() -> None:
    counts = StepCounts()
    counts.add(FakeSample(), fresh=True, trained_tokens=7)
    counts.add(FakeSample(), fresh=True, trained_tokens=5)
    counts.add(FakeSample(user_error=USER_ERROR), fresh=True, trained_tokens=0)
    counts.add(FakeSample(judged_ok=False), fresh=True, trained_tokens=0)
    counts.add(FakeSample(), fresh=False, trained_tokens=0)
    counts.add(FakeSample(), fresh=False, trained_tokens=0)
    counts.add(FakeSample(filtered=True), fresh=True, trained_tokens=0)
    record = counts.to_dict()
    assert record == {"samples": 7, "trained_samples": 2, "trained_tokens": 12,
                      "user_errors": 1, "judge_failed": 1, "masked_stale": 2, "filtered": 1,
                      "judge_own": 0, "poison": 0, "dropped": 5}
    assert record["samples"] == record["trained_samples"] + record["dropped"]
    assert record["dropped"] == sum(record[k] for k in NOT_TRAINED)


def test_a_sample_is_counted_under_its_first_reason_only() -> None:
    counts = StepCounts()
    # user code failed, the judge failed and it is stale: user code comes first
    counts.add(FakeSample(judged_ok=False, user_error=USER_ERROR), fresh=False,
               trained_tokens=0)
    # the judge failed and it is stale: the judge comes before staleness
    counts.add(FakeSample(judged_ok=False), fresh=False, trained_tokens=0)
    # stale, and its group dropped by dynamic sampling: staleness comes first
    counts.add(FakeSample(filtered=True), fresh=False, trained_tokens=0)
    assert (counts.user_errors, counts.judge_failed, counts.masked_stale,
            counts.filtered) == (1, 1, 1, 0)
    assert counts.dropped == 3 and counts.trained_samples == 0
    with pytest.raises(ValueError, match="not trained has tokens in the loss"):
        counts.add(FakeSample(filtered=True), fresh=True, trained_tokens=2)


def test_judge_failures_of_the_judges_own_cause_and_poison_inputs_are_counted_apart() -> None:
    counts = StepCounts()
    counts.add(FakeSample(judged_ok=False, judge_kind="exception"), fresh=True,
               trained_tokens=0)
    counts.add(FakeSample(judged_ok=False, judge_kind="poison", poison=1), fresh=True,
               trained_tokens=0)
    counts.add(FakeSample(judged_ok=False, judge_kind="unavailable"), fresh=True,
               trained_tokens=0)
    counts.add(FakeSample(user_error={**USER_ERROR, "kind": "poison"}, poison=1), fresh=True,
               trained_tokens=0)
    counts.add(FakeSample(poison=1), fresh=True, trained_tokens=3)   # a poison tool call
    assert (counts.judge_failed, counts.judge_own, counts.poison) == (3, 2, 3)
    assert counts.dropped == 4 and counts.trained_samples == 1


def test_a_not_trained_sample_with_tokens_in_the_loss_raises() -> None:
    counts = StepCounts()
    with pytest.raises(ValueError, match="not trained has tokens in the loss"):
        counts.add(FakeSample(), fresh=False, trained_tokens=3)
    with pytest.raises(ValueError, match="not trained has tokens in the loss"):
        counts.add(FakeSample(judged_ok=False), fresh=True, trained_tokens=1)
    assert counts.trained_tokens == 0


def test_trained_tokens_counts_a_refed_step_once_the_last_record_winning() -> None:
    records = [{"phase": "warm_start", "step": 0, "trained_tokens": 999},
               rl(0, trained_tokens=100), rl(1, trained_tokens=50),
               rl(1, trained_tokens=60),  # step 1 fed again after a learner rewind
               rl(2, trained_tokens=40), {"phase": "rl", "trained_tokens": 5}]  # no step
    assert trained_tokens(records) == 200


def test_not_trained_counts_a_refed_step_once() -> None:
    records = [rl(0, user_errors=1, judge_failed=2, masked_stale=0),
               rl(0, user_errors=1, judge_failed=2, masked_stale=3),
               rl(1, user_errors=0, judge_failed=0, masked_stale=1)]
    assert not_trained(records) == {"user_errors": 1, "judge_failed": 2, "masked_stale": 4,
                                    "filtered": 0}


def test_an_old_record_reads_judge_marked_and_the_stale_from_dropped() -> None:
    old = rl(0, judge_marked=2, user_errors=1, dropped=6)
    assert not_trained([old]) == {"user_errors": 1, "judge_failed": 2, "masked_stale": 3,
                                  "filtered": 0}
    older = rl(1, judge_marked=0, dropped=0)  # before user code was a domain
    assert not_trained([older]) == {"user_errors": 0, "judge_failed": 0, "masked_stale": 0,
                                    "filtered": 0}


def test_goodput_is_tokens_per_second_and_0_for_an_empty_interval() -> None:
    assert goodput(300, 2.0) == pytest.approx(150.0)
    assert goodput(300, 0.0) == 0.0
    assert goodput(300, -1.0) == 0.0

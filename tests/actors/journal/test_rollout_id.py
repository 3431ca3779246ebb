"""The rollout id's one format, written and read back by one type."""

from __future__ import annotations

import pytest

from erlay.actors.journal.rollout_id import RolloutId, step_of


@pytest.mark.parametrize("rid", [RolloutId(0, 0, 0), RolloutId(42, 3, 15),
                                 RolloutId(123456, 1000, 7)])
def test_format_and_parse_invert_each_other(rid: RolloutId) -> None:
    assert RolloutId.parse(rid.format()) == rid
    assert step_of(rid.format()) == rid.step


@pytest.mark.parametrize("text", ["v00001-0002", "r1-g000-0", "r00001-g0-0", "r00001-g000-",
                                  "r00001-g000-1x", "", "x00001-g000-1"])
def test_what_is_no_training_rollout_id_parses_to_none(text: str) -> None:
    assert RolloutId.parse(text) is None and step_of(text) is None


def test_negative_parts_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        RolloutId(-1, 0, 0)

"""The coordinator's calls into a multi-rank learner while its domain restarts: an attempt
calls every rank or none, so no rank is left in a collective its peers never join."""

from __future__ import annotations

import asyncio
from typing import Any

from erlay.actors.job.coordinator import RolloutCoordinator
from erlay.supervisor.errors import ChildNotRunning
from tests.actors.job.test_data_job import _context


class _Rank:
    """A learner rank's ChildRef: not running for its first ``down`` lookups (a restart in
    progress), then an actor that records each call and answers at once."""

    def __init__(self, path: str, down: int) -> None:
        self.path, self.down, self.calls = path, down, []
        self.incarnation = 1

    @property
    def actor(self) -> Any:
        if self.down > 0:
            self.down -= 1
            raise ChildNotRunning(f"{self.path} is restarting")
        rank = self

        class _Method:
            def __init__(self, name: str) -> None:
                self.name = name

            def remote(self, *args: Any) -> asyncio.Future[Any]:
                rank.calls.append(self.name)
                answer = asyncio.get_running_loop().create_future()
                answer.set_result({"step": 4, "exposed_s": 0.0, "committed": None})
                return answer

        class _Actor:
            def __getattr__(self, name: str) -> _Method:
                return _Method(name)

        return _Actor()


def calls_while_rank_1_restarts(down: int) -> tuple[list[str], list[str]]:
    coord = RolloutCoordinator(_context(reported=0))
    # Rank 0 already runs its new incarnation; rank 1 is still starting.
    ranks = [_Rank("erlay/learner/learner-0", 0), _Rank("erlay/learner/learner-1", down)]
    coord.learners = ranks  # type: ignore[assignment]
    result = asyncio.run(coord._learner_call("save_checkpoint", {}, all_ranks=True))
    assert result["step"] == 4
    return ranks[0].calls, ranks[1].calls


def test_no_rank_is_called_until_every_rank_runs() -> None:
    rank0, rank1 = calls_while_rank_1_restarts(down=3)
    # One collective save, joined by both: before, each failed attempt also called rank 0,
    # which then waited in three saves rank 1 never joined (the job stalled).
    assert rank0 == rank1 == ["save_checkpoint"]


def test_a_learner_already_running_is_called_once() -> None:
    assert calls_while_rank_1_restarts(down=0) == (["save_checkpoint"], ["save_checkpoint"])

"""The learner rank as a supervised actor child: :class:`~actors.learner_core.LearnerCore`
plus the Ray object store.

Start it as ``ChildSpec("learner-0", ActorStart(Learner, kwargs={"model_config": ...}))``.
All public methods are synchronous, so the supervisor runs it as a threaded actor: its
monitor and progress probes answer on their own threads while a train step runs, and the
step's progress ticks (phase ``train_step``, or ``sft``) are what hang detection reads.

Ranks of a data-parallel learner are siblings under a ``one_for_all`` supervisor (they share
a gloo process group, so one rank's death breaks the others' collectives).  Only rank 0
publishes weights; every rank holds the same weights after each step.
"""

from __future__ import annotations

from typing import Any

import ray

from actors.learner_core import LearnerCore, TrainBatch

__all__ = ["Learner", "TrainBatch"]


class Learner(LearnerCore):
    """One learner rank; see :class:`~actors.learner_core.LearnerCore` for the contracts."""

    def publish(self) -> tuple[int, list[Any]]:
        """``(version, [ref])``: the current weights put in the object store.

        The ref sits in a list so that Ray hands it to the caller as a ref instead of
        resolving it.  This actor owns the object: it stays readable while this incarnation
        lives, so engines should fetch it before the learner could be restarted, and a new
        incarnation publishes again.  Raises RuntimeError on ranks other than 0.
        """
        if self.rank != 0:
            raise RuntimeError(f"learner rank {self.rank} does not publish weights; rank 0 does")
        version, weights = self.versioned_weights()
        return version, [ray.put(weights)]

    def erlay_terminate(self) -> None:
        """On a polite shutdown, leave the process group so peers fail fast, not by timeout."""
        self.close()

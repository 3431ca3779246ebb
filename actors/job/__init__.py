"""The job: the supervision tree of the RL components, and the loop that runs in it.

- :mod:`.driver`: :class:`Job`, which builds the tree (learner, generation, sandbox, judge,
  rollout domains), runs it to the end and writes the run directory;
- :mod:`.coordinator`: the asynchronous GRPO loop, an in-process child of the rollout domain;
- :mod:`.rollout`: one (multi-turn) episode, start to reward, journaled transition by
  transition;
- :mod:`.domains`: the clients the coordinator uses to reach the other fault domains;
- :mod:`.node_runtime`: what every node gets before the tree starts (caches, versions,
  declared environment, NUMA binding);
- :mod:`.remote_runs`: runs on an object store, resumed, exported and reported from there.

``Job``, ``JobResult`` and ``ROOT`` are importable from here; they load on first use, so
importing :mod:`erlay.actors.job.node_runtime` alone does not pull in the whole job.

May import: erlay.supervisor, erlay.environments, erlay.sandbox, erlay.judges,
erlay.actors.config, erlay.actors.rundir, erlay.actors.model, erlay.actors.journal,
erlay.actors.engine, erlay.actors.learner, erlay.actors.observe, erlay.actors.data,
erlay.actors.control, erlay.actors.storage.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ROOT", "Job", "JobResult"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from erlay.actors.job import driver
        return getattr(driver, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

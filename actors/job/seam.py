"""What the driver hands the rollout coordinator: exactly what it needs, typed.

The driver (:mod:`erlay.actors.job.driver`) builds one :class:`CoordinatorContext` for each
incarnation of the coordinator when the rollout domain starts it; the coordinator reads
nothing else of the job.  What flows back to the job goes through the callbacks here (a
metrics record, an abort, a failed save, the step training ended at), never through
attributes set on the job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from erlay.actors.config import JobConfig
from erlay.actors.control.policy import Action
from erlay.actors.job.rollout import RolloutObserver
from erlay.actors.journal.store import Journal
from erlay.actors.journal.transitions import TransitionSink
from erlay.actors.model.tokens import Tokenizer
from erlay.actors.rundir import RunDir
from erlay.supervisor.tree import SupervisionTree


@dataclass(frozen=True)
class DomainPaths:
    """The tree paths of the job's children, by domain."""

    learners: list[str]
    engines: list[str]
    sandbox_hosts: list[str]
    sandbox_workers: list[str]
    judge_hosts: list[str]
    environment_hosts: list[str]


@dataclass(frozen=True)
class CoordinatorContext:
    """One coordinator incarnation's view of its job.

    ``tree`` and ``paths``: where its domain clients find their children; ``journal``: the
    durable journal (None when the job runs without one), ``sink``: where every transition
    goes (the journal, teed to a test's sink); ``tokenizer`` and ``max_seq_len``: the
    model plan's; ``validation_rows``: rows of ``data.validation`` (0: no validation);
    ``observer``: the telemetry hub the rollouts report to.  Callbacks: ``report`` one
    metrics record, ``abort`` the job as failed (a broken plug-in), ``checkpoint_failed``
    a learner save given up (step, reason), ``training_ended`` at the step it reached,
    ``control`` one action of the goodput controller (an event with its reason).
    """

    cfg: JobConfig
    run_dir: RunDir
    tree: SupervisionTree
    paths: DomainPaths
    journal: Journal | None
    sink: TransitionSink
    tokenizer: Tokenizer
    max_seq_len: int
    validation_rows: int
    observer: RolloutObserver | None
    report: Callable[[dict[str, Any]], None]
    abort: Callable[[str], None]
    checkpoint_failed: Callable[[int, str], None]
    training_ended: Callable[[int], None]
    control: Callable[[Action], None]

"""Colocated placement (``placement.colocate``) end to end, on a real local Ray: learner rank 0
and engine 0 in bundle 0 of one placement group, the engine asleep for every train step,
and an engine SIGKILLed while the learner trains restarted alone, in the same group, while
the learner's step completes on the same incarnation.

One short job on the built-in model carries all of it (a job start costs seconds here).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from erlay.actors.config import load_config
from erlay.actors.job.driver import Job, JobResult
from erlay.actors.rundir import RunDir
from erlay.supervisor.events import EventKind, read_events
from tests.conftest import wait_for
from tests.paths import REPO

CONFIG = REPO / "configs" / "cpu-builtin.yaml"
LEARNER, ENGINE = "erlay/learner/learner-0", "erlay/generation/engine-0"
pytestmark = pytest.mark.ray


def placement_group_of(job: Job, path: str) -> str:
    """The placement group the live actor at ``path`` runs in, asked inside the actor."""
    import ray

    def where(_: Any) -> str:
        return str(ray.get_runtime_context().get_placement_group_id())

    actor = job.tree.ref(path).actor
    return str(ray.get(actor.__ray_call__.remote(where), timeout=10))


def test_a_colocated_job_sleeps_its_engine_per_step_and_restarts_a_killed_engine_alone(
        tmp_path: Path, fresh_ray: None) -> None:
    import ray
    from ray.util.placement_group import placement_group_table
    cfg = load_config(CONFIG, [
        "run.steps=4", "warm_start.steps=10", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "placement.colocate=true", "ray.num_cpus=4",
        f"run.storage={tmp_path}"])
    job = Job(cfg, RunDir.create(tmp_path, "colocated"))
    results: list[JobResult] = []
    thread = threading.Thread(target=lambda: results.append(job.run(progress=False)))
    thread.start()
    try:
        wait_for(lambda: job.run_dir.rl_steps(), timeout=120, what="the first RL step")
        group = job.placement.group
        table = placement_group_table(group)
        assert table["state"] == "CREATED" and table["strategy"] == "STRICT_PACK"
        assert list(table["bundles"].values()) == [{"CPU": 1.0}]
        pg = group.id.hex()
        assert placement_group_of(job, LEARNER) == placement_group_of(job, ENGINE) == pg
        learner_incarnation = job.tree.ref(LEARNER).incarnation
        # The next train step takes 3 s, and the engine dies while it runs, asleep.
        job.tree.ref(LEARNER).actor._erlay_failpoints.remote(
            "arm", "learner.train_step", {"action": "delay", "delay_s": 3.0, "count": 1})
        coordinator = job.coordinator
        wait_for(lambda: coordinator.colocation.asleep
                 and coordinator.progress.snapshot().phase == "train_step"
                 and len(job.run_dir.rl_steps()) >= 1, timeout=60, interval=0.005,
                 what="a colocated train step")
        killed_at_step = len(job.run_dir.rl_steps())
        engine_incarnation = job.tree.ref(ENGINE).incarnation
        os.kill(int(job.tree.ref(ENGINE).process.info["pid"]), signal.SIGKILL)
        wait_for(lambda: job.tree.ref(ENGINE).incarnation != engine_incarnation, timeout=60,
                 what="engine-0's restart")
        assert placement_group_of(job, ENGINE) == pg   # the restart kept its bundle
        assert job.tree.ref(LEARNER).incarnation == learner_incarnation
    finally:
        thread.join(timeout=300)
        ray.shutdown()
    assert results and results[0].status == "finished", results and results[0].reason
    steps = job.run_dir.rl_steps()
    assert [m["step"] for m in steps] == list(range(4))
    assert killed_at_step in {m["step"] for m in steps}   # the step it died under trained
    assert all(m["colocation_slept"] == 1 for m in steps)  # asleep for every train step
    assert sum(m["colocation_woken"] for m in steps) >= len(steps) - 1
    events = read_events(job.run_dir.events)
    restarted = {e.path for e in events if e.context is EventKind.RESTART}
    assert ENGINE in restarted and LEARNER not in restarted

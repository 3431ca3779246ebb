"""Dataset-backed jobs: the data position follows the learner's step across a resume, and
validation runs every N steps through the rollout path, reported apart and never journaled
as training rollouts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from erlay.actors.config import load_config
from erlay.actors.data.rows import load_rows
from erlay.actors.job.coordinator import RolloutCoordinator
from erlay.actors.job.driver import Job
from erlay.actors.job.rollout import Trajectory
from erlay.actors.job.seam import CoordinatorContext, DomainPaths
from erlay.actors.job.validation import summarize
from erlay.actors.journal.store import Journal
from erlay.actors.journal.transitions import NullTransitions
from erlay.actors.rundir import RunDir
from erlay.environments.dataset import DatasetEnv
from tests.actors.job.inline_env import inline_environment
from tests.paths import REPO

GSM = REPO / "configs" / "gsm8k-tiny.yaml"
PROMPTS, GROUP = 4, 2


class _RunDir:
    def __init__(self, reported: int) -> None:
        self.reported = reported

    def rl_steps(self) -> list[dict[str, Any]]:
        return [{"phase": "rl", "step": s} for s in range(self.reported)]


def _context(reported: int) -> CoordinatorContext:
    """What the coordinator gets of its job, without Ray: no tree (setup is not called),
    a run dir that reports ``reported`` steps, nothing journaled."""
    cfg = load_config(GSM, [f"rollout.prompts_per_step={PROMPTS}",
                            f"rollout.group_size={GROUP}"])
    return CoordinatorContext(
        cfg=cfg, run_dir=_RunDir(reported), tree=None,  # type: ignore[arg-type]
        paths=DomainPaths([], [], [], [], [], []), journal=None, sink=NullTransitions(),
        tokenizer=None, max_seq_len=0, validation_rows=0,  # type: ignore[arg-type]
        observer=None, report=lambda record: None, abort=lambda reason: None,
        checkpoint_failed=lambda step, reason: None, training_ended=lambda step: None,
        control=lambda action: None)


class _Runner:
    """Records which row each rollout plays."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int]] = []   # (episode index, row)

    async def play(self, rid: str, step: int, group: int, episode: Any, index: int,
                   history: Any) -> Trajectory:
        self.rows.append((index, episode.metadata["row"]))
        return Trajectory(rid, step, group, index, [1])


def coordinator(learner_step: int | None) -> RolloutCoordinator:
    """A coordinator whose learner is fresh (None) or was restored at ``learner_step``."""
    ctx = _context(reported=learner_step or 0)
    coord = RolloutCoordinator(ctx)
    coord.env = inline_environment(DatasetEnv(load_rows(ctx.cfg.data), name="gsm"),
                                   "erlay.environments.dataset:DatasetEnv")
    coord.runner = _Runner()  # type: ignore[assignment]

    async def learner_call(method: str, *args: Any, **kw: Any) -> Any:
        assert method == "status", method
        return {"warm_started": learner_step is not None, "step": learner_step or 0,
                "version": (learner_step or 0) + 1, "committed": learner_step,
                "restored": True}

    async def publish() -> None:
        return None

    coord._learner_call = learner_call  # type: ignore[method-assign]
    coord._publish = publish  # type: ignore[method-assign]
    return coord


def step_rows(coord: RolloutCoordinator, n: int) -> list[tuple[int, int]]:
    runner = coord.runner
    assert isinstance(runner, _Runner)
    runner.rows.clear()
    asyncio.run(coord._generate_step(n))
    return sorted(set(runner.rows))


def test_a_resumed_coordinator_plays_the_rows_an_uninterrupted_run_plays() -> None:
    """``--resume`` restores the learner's step; the coordinator continues from it, and the
    episode index, and so the dataset row, follows: no row replayed, none skipped."""
    uninterrupted = coordinator(None)
    expected = [step_rows(uninterrupted, n) for n in range(20)]   # 80 episodes: 2 epochs
    resumed = coordinator(learner_step=13)
    start = asyncio.run(resumed._restore_or_warm_start())
    assert start == 13
    for n in range(start, 20):
        assert step_rows(resumed, n) == expected[n]
    assert [i for i, _ in expected[13]] == list(range(13 * PROMPTS, 14 * PROMPTS))
    assert expected[13] != expected[0]
    epoch0 = sorted(r for n in range(12) for _, r in expected[n])   # 12 steps x 4 = 48 rows
    assert epoch0 == list(range(48)), "each row once per epoch"


def test_the_validation_record_counts_only_judged_samples() -> None:
    def traj(reward: float, judged: bool = True, failure: str | None = None) -> Trajectory:
        t = Trajectory("v", 3, 0, 0, [1], reward=reward, judged_ok=judged, failure=failure)
        t.generated_tokens = 2
        return t
    record = summarize(3, [traj(1.0), traj(0.0, failure="no answer tag"),
                           traj(0.0, judged=False)], 0.5)
    assert record["phase"] == "validation" and record["step"] == 3
    assert record["val_reward"] == 0.5 and record["val_accuracy"] == 0.5
    assert (record["val_samples"], record["val_valid"], record["val_failures"]) == (3, 2, 1)


@pytest.mark.ray
def test_validation_runs_every_n_steps_apart_from_training(tmp_path: Path,
                                                           fresh_ray: None) -> None:
    steps, every, size = 4, 2, 5
    cfg = load_config(GSM, [
        f"run.steps={steps}", f"data.validation_every={every}", f"data.validation_size={size}",
        "warm_start.steps=3", f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.group_size={GROUP}", "rollout.max_staleness=0", "ray.num_cpus=4",
        f"run.storage={tmp_path}"])
    job = Job(cfg, RunDir.create(tmp_path, "val"))
    result = job.run(progress=False)
    assert result.status == "finished", result.reason
    metrics = job.run_dir.read_metrics()
    validations = [m for m in metrics if m.get("phase") == "validation"]
    assert [m["step"] for m in validations] == [1, 3]
    for m in validations:
        assert m["val_samples"] == size and "error" not in m
        assert 0.0 <= m["val_reward"] <= 1.0 and m["val_gen_tokens"] > 0
    rl = job.run_dir.rl_steps()
    assert [m["step"] for m in rl] == list(range(steps))
    assert all("val_reward" not in m and m["samples"] == PROMPTS * GROUP for m in rl)
    # Exactly-once accounting sees training rollouts only: none of validation's reached the
    # journal, and every training rollout was consumed once, by its own step.
    with Journal.open(job.run_dir.journal, read_only=True) as journal:
        consumed = dict(journal.state.consumed)
        ids = set(journal.state.rollouts) | set(consumed)
    assert not [rid for rid in ids if not rid.startswith("r")]
    assert len(consumed) == steps * PROMPTS * GROUP
    assert all(int(rid[1:6]) == step for rid, step in consumed.items())

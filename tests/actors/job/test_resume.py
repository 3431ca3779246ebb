"""Exactly-once training and ``--resume``, on a real local Ray with real checkpoints.

- A learner SIGKILLed mid-run restores its last committed checkpoint; the steps since that
  checkpoint are fed again, each rollout to the step that consumed it before, none twice.
- A driver SIGKILLed mid-step is resumed with ``erlay run --resume``; the continuation's
  metrics and consumption are those of an uninterrupted run with the same seeds (the loop is
  synchronous here, ``max_staleness=0``, so both runs are deterministic).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from erlay.actors.config import load_config
from erlay.actors.job.driver import Job, JobResult
from erlay.actors.journal.store import Journal
from erlay.actors.learner.checkpoint import latest
from erlay.actors.rundir import RunDir
from tests.conftest import wait_for
from tests.paths import REPO

ROOT = REPO
# The built-in model: resume is model-agnostic, and its actors start ~6 s sooner than the HF
# default's (no transformers import); the HF default's job runs in test_e2e and the chaos
# smoke scenarios.
CONFIG = ROOT / "configs" / "cpu-builtin.yaml"
SMALL = ["warm_start.steps=30", "rollout.prompts_per_step=8", "rollout.group_size=4",
         "rollout.max_staleness=0", "checkpoint.every_steps=2", "ray.num_cpus=4",
         "learner.lr_decay_steps=0"]
pytestmark = pytest.mark.ray


def consumed(run_dir: Path) -> dict[str, int]:
    with Journal.open(run_dir / "journal", read_only=True) as journal:
        return dict(journal.state.consumed)


def check_exactly_once(by_id: dict[str, int], steps: int, per_step: int) -> None:
    """Every rollout of every step consumed, by the step whose data it is, exactly once."""
    assert len(by_id) == steps * per_step
    for rid, step in by_id.items():
        assert int(rid[1:6]) == step, (rid, step)
    counts = [sum(1 for s in by_id.values() if s == n) for n in range(steps)]
    assert counts == [per_step] * steps


def test_learner_restart_feeds_the_steps_since_its_checkpoint_again(
        tmp_path: Path, fresh_ray: None) -> None:
    steps = 7
    cfg = load_config(CONFIG, [*SMALL, f"run.steps={steps}", f"run.storage={tmp_path}"])
    job = Job(cfg, RunDir.create(tmp_path, "learner-kill"))
    results: list[JobResult] = []
    runner = threading.Thread(target=lambda: results.append(job.run(progress=False)))
    runner.start()
    ckpts = job.run_dir.checkpoints

    def killable() -> int | None:
        # A step past the newest committed checkpoint, and not one about to be saved: the
        # restarted learner must come back behind the coordinator.
        assert job.tree is not None
        learner = job.tree.ref("erlay/learner/learner-0")
        import ray
        step = ray.get(learner.actor.status.remote(), timeout=10)["step"]
        info = latest(ckpts)
        if info is not None and step >= 2 and step % 2 and step > info.step:
            return int(learner.process.info["pid"])
        return None

    pid = wait_for(killable, 240, interval=0.05, what="a learner past its checkpoint")
    os.kill(pid, signal.SIGKILL)
    runner.join(timeout=300)
    assert results and results[0].status == "finished", results and results[0].reason
    metrics = job.run_dir.read_metrics()
    rewinds = [m for m in metrics if m.get("phase") == "rewind"]
    assert rewinds and rewinds[0]["to_step"] < rewinds[0]["from_step"]
    assert [m["step"] for m in job.run_dir.rl_steps()] == list(range(steps))  # no dup, no gap
    check_exactly_once(consumed(job.run_dir.path), steps, 32)


def erlay(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "erlay.supervisor.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


STEPS = 6
DRIVER_ARGS = ["run", str(CONFIG), *SMALL, f"run.steps={STEPS}", "--no-progress"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of :data:`DRIVER_ARGS`: what every resumed run must match."""
    import ray
    if ray.is_initialized():
        ray.shutdown()
    where = tmp_path_factory.mktemp("reference")
    done = erlay(*DRIVER_ARGS, f"run.storage={where}")
    assert done.returncode == 0, done.stderr[-3000:]
    # --no-progress: one log line per RL step in place of the bar
    progress = re.findall(r"erlay\.progress: step (\d+)/6 reward \S+ tokens/s \S+ restarts 0$",
                          done.stderr, re.MULTILINE)
    assert progress == [str(n) for n in range(1, STEPS + 1)], done.stderr[-3000:]
    (ref_dir,) = where.iterdir()
    return ref_dir


def kill_driver_mid_run(extra: list[str], reached: Callable[[], object],
                        env: dict[str, str] | None = None) -> object:
    """Start ``erlay run`` with :data:`DRIVER_ARGS` and ``extra``, SIGKILL its driver once
    ``reached()`` is truthy, and return that value."""
    import ray
    if ray.is_initialized():
        ray.shutdown()
    killed = subprocess.Popen([sys.executable, "-m", "erlay.supervisor.cli", *DRIVER_ARGS,
                               *extra], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True,
                              env=env)
    try:
        value = wait_for(reached, 300, interval=0.05, what="the run mid-way")
        os.kill(killed.pid, signal.SIGKILL)  # the driver only: Ray's processes share its fate
        killed.wait(timeout=30)
    finally:
        try:
            os.killpg(killed.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return value


@pytest.mark.slow
def test_resume_after_sigkill_of_the_driver_matches_an_uninterrupted_run(
        tmp_path: Path, reference: Path) -> None:
    def mid_run() -> Path | None:
        for run in (tmp_path / "killed").glob("arithmetic-*"):
            steps_done = RunDir(run).rl_steps()
            if steps_done and steps_done[-1]["step"] >= 2:
                return run
        return None
    run_dir = kill_driver_mid_run([f"run.storage={tmp_path / 'killed'}"], mid_run)
    assert isinstance(run_dir, Path)
    before = RunDir(run_dir).rl_steps()
    assert len(before) < STEPS  # it really was cut short

    resumed = erlay("run", "--resume", str(run_dir), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = RunDir(run_dir).rl_steps(), RunDir(reference).rl_steps()
    assert [m["step"] for m in got] == list(range(STEPS))
    assert [m["reward_mean"] for m in got] == [m["reward_mean"] for m in want]
    assert consumed(run_dir) == consumed(reference)
    check_exactly_once(consumed(run_dir), STEPS, 32)
    summary = (run_dir / "summary.md").read_text()
    assert "status: **finished**" in summary
    # The summary is the whole run's: both driver runs and the outage between them.
    wall = re.search(r"^- wall time: ([\d.]+) s \(2 driver runs: ([\d.]+) s, ([\d.]+) s; and "
                     r"the outage\)$", summary, re.MULTILINE)
    outage = re.search(r"^- time lost to the outage: ([\d.]+) s", summary, re.MULTILINE)
    assert wall and outage, summary
    total, first, second, lost = (float(x) for x in (*wall.groups(), outage.group(1)))
    assert lost > 0 and total == pytest.approx(first + second + lost, abs=0.2)
    assert "- RL steps: 6\n" in summary and "/s over the RL time)" in summary


@pytest.mark.slow
def test_a_run_on_s3_resumes_on_a_fresh_machine_after_its_driver_is_killed(
        tmp_path: Path, reference: Path) -> None:
    """The run's home is an S3 bucket (moto's server on loopback); its driver is SIGKILLed
    mid-run, once the bucket holds a checkpoint, and its local working copy deleted (the head
    machine is gone).  ``--resume s3://...`` on a fresh staging directory fetches the run,
    restores the newest checkpoint the remote journal reaches and finishes; the run then
    matches an uninterrupted one, and ``erlay verify``, ``export`` and ``report`` work from
    the bucket alone.  The kill, the resume and the verify are ``bench/storage.py``'s own
    trial (its CI smoke run: tests/test_bench_storage.py)."""
    from bench.storage import trial
    from erlay.actors.storage.fetch import fetch_run
    from erlay.actors.storage.remote import open_remote
    from tests.s3server import aws_env, s3_server

    with s3_server() as s3, aws_env(s3):
        env = {**os.environ, **s3.env()}
        got = trial(s3, tmp_path, DRIVER_ARGS[1:-1], every=0.5, kill_at=3, checkpointed=True)
        assert got["resumed_ok"] and got["verified_ok"], got
        assert got["steps_retrained"] <= 3, got   # from the checkpoint the bucket held
        url = got["url"]

        # Everything below reads the bucket only.
        copy = tmp_path / "copy"
        fetch_run(open_remote(url), copy, checkpoint="none")
        steps, want = RunDir(copy).rl_steps(), RunDir(reference).rl_steps()
        assert [m["step"] for m in steps] == list(range(STEPS))
        assert [m["reward_mean"] for m in steps] == [m["reward_mean"] for m in want]
        assert consumed(copy) == consumed(reference)
        check_exactly_once(consumed(copy), STEPS, 32)
        assert "status: **finished**" in (copy / "summary.md").read_text()
        name = url.rsplit("/", 1)[1]
        exported = subprocess.run([sys.executable, "-m", "erlay.supervisor.cli", "export",
                                   url, s3.url("exports", name)], cwd=ROOT,
                                  capture_output=True, text=True, timeout=120, env=env)
        assert exported.returncode == 0, exported.stderr[-3000:]
        assert "model.safetensors" in open_remote(s3.url("exports", name)).listing()
        report = subprocess.run([sys.executable, "-m", "erlay.supervisor.cli", "report", url],
                                cwd=ROOT, capture_output=True, text=True, timeout=120,
                                env=env)
        assert report.returncode == 0, report.stderr[-3000:]
        assert open_remote(url).exists("report/report.md")


def test_an_escalation_between_a_learner_step_and_its_journal_record_resumes_exactly_once(
        tmp_path: Path, fresh_ray: None) -> None:
    """The coordinator dies after the learner trained step 3 (in its ledger) and before the
    journal recorded the consumption, and the job escalates (no restart allowed).  The newest
    checkpoint (step 2) kept steps 0-1: step 3's training died with the run, which
    ``erlay verify`` reports and passes.  Had a checkpoint kept step 3 (planted on a copy: a
    real checkpoint committed at step 4), a resume would train it twice: verify fails it.
    The resume restores step 2, trains 2 and 3 from the journal, and verifies clean."""
    import shutil

    from erlay.actors.learner.checkpoint.format import step_dir_name, write_checkpoint_dir
    from erlay.chaos.verify import verify
    from erlay.supervisor import failpoints

    steps = 6
    cfg = load_config(CONFIG, [*SMALL, f"run.steps={steps}", f"run.storage={tmp_path}",
                               "supervision.rollout.intensity=0",
                               "supervision.root.intensity=0"])
    failpoints.arm("rollout.after_train", "raise", nth=4)    # the 4th step: step 3
    try:
        result = Job(cfg, RunDir.create(tmp_path, "after-train")).run(progress=False)
    finally:
        failpoints.disarm("rollout.after_train")
    assert result.status == "failed", result.reason
    path = next(tmp_path.glob("after-train-*"))
    failed = verify(path)
    once = next(v for v in failed.verdicts if v.name == "exactly_once")
    assert failed.ok, [v for v in failed.verdicts if v.ok is False]
    assert "32 trained after the last checkpoint" in once.detail, once.detail
    assert "lost with the run" in once.detail

    kept = tmp_path / "kept"
    shutil.copytree(path, kept)
    import torch
    write_checkpoint_dir(kept / "checkpoints" / step_dir_name(4), 4,
                         {"w": torch.zeros(4)}, {})
    planted = next(v for v in verify(kept).verdicts if v.name == "exactly_once")
    assert planted.ok is False and "trained into the checkpoint at step 4" in planted.detail

    resumed = Job(load_config(path / "config.yaml", []), RunDir.open(path)).run(progress=False)
    assert resumed.status == "finished", resumed.reason
    after = verify(path)
    assert after.ok, [v for v in after.verdicts if v.ok is False]
    once = next(v for v in after.verdicts if v.name == "exactly_once")
    assert "lost with the run" not in once.detail
    assert [m["step"] for m in RunDir(path).rl_steps()] == list(range(steps))
    check_exactly_once(consumed(path), steps, 32)

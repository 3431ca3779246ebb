"""A save killed at each of its stages: snapshot, write, fsync, rename and cleanup.

Each scenario starts a real trainer process over a root that already holds a committed
checkpoint of step 1, saves step 2 through :class:`AsyncCheckpointer` (``keep=1``) with one
stage's failpoint armed, and checks from the disk alone that a complete checkpoint is
there, step 1's or step 2's as the stage implies, then that the next checkpointer removes
every leftover and its next save commits.

The snapshot is killed with a real SIGKILL: the copy hangs mid-way at its failpoint, so any
kill after save() has returned strikes mid-snapshot.  The other stages are armed to ``exit``
(``os._exit``) at their exact point, in the worker (write, fsync) or in the trainer (the
commit's renames, retention): no handler, ``finally`` or ``atexit`` runs, which for the
files on disk and for the processes watching is what SIGKILL leaves, only deterministic.
A worker that dies fails the save with :class:`CheckpointSaveFailed` in a trainer that lives
on; a trainer that dies takes its worker along.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from erlay.actors.learner.checkpoint import AsyncCheckpointer, latest, list_checkpoints, load
from erlay.actors.learner.checkpoint.format import write_checkpoint_dir
from erlay.supervisor import failpoints
from tests.paths import REPO

CRASH_EXIT = 86  # the failpoint's exit code: proves the crash came from the point armed
SIZE = 5_000_000  # floats: 20 MB, two snapshot chunks and many writes into state.pt

TRAINER = """
import sys, torch
from erlay.actors.learner.checkpoint import AsyncCheckpointer, CheckpointSaveFailed
checkpointer = AsyncCheckpointer(sys.argv[1], keep=1)
checkpointer.save(2, {"w": torch.full((SIZE,), 2.0), "b": torch.full((8,), 2.0)}, {"v": 2})
print("saved", flush=True)
checkpointer.wait_snapshot()
try:
    checkpointer.wait(timeout_s=300)
    print("committed", flush=True)
except CheckpointSaveFailed as exc:
    print("failed:", exc.reason, flush=True)
checkpointer.close()
""".replace("SIZE", str(SIZE))


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((SIZE,), value), "b": torch.full((8,), value)}


def committed_step_one(root: Path) -> None:
    root.mkdir()
    write_checkpoint_dir(root / "step-00000001", 1, state(1.0), {"v": 1})


def assert_holds(root: Path, step: int) -> None:
    """The newest complete checkpoint is ``step``'s, whole (checksums verified)."""
    info = latest(root)
    assert info is not None and info.step == step, sorted(p.name for p in root.iterdir())
    loaded, extra = load(info.path)
    assert extra == {"v": step}
    for key, tensor in state(float(step)).items():
        assert torch.equal(loaded[key], tensor), key


def assert_next_checkpointer_recovers(root: Path, survivor: int) -> None:
    """The next checkpointer leaves only committed checkpoints, and its save commits."""
    with AsyncCheckpointer(root, keep=1) as checkpointer:
        assert all(p.name.startswith("step-") for p in root.iterdir()), \
            sorted(p.name for p in root.iterdir())
        assert_holds(root, survivor)
        checkpointer.save(3, state(3.0), {"v": 3})
        checkpointer.wait_snapshot()
        assert checkpointer.wait(timeout_s=300) == [3]
    assert [info.step for info in list_checkpoints(root)] == [3]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003"]
    assert_holds(root, 3)


def trainer(root: Path, point: str, action: str) -> subprocess.Popen[str]:
    spec = {"action": action, "exit_code": CRASH_EXIT}
    env = {**os.environ, failpoints.ENV_VAR: failpoints.env_value({point: spec})}
    return subprocess.Popen([sys.executable, "-c", TRAINER, str(root)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_trainer_sigkilled_mid_snapshot_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    committed_step_one(root)
    process = trainer(root, "learner.checkpoint_snapshot", "hang")
    try:
        assert process.stdout.readline().strip() == "saved"  # type: ignore[union-attr]
    finally:
        process.kill()  # SIGKILL, while the copy hangs after its first chunk
        process.wait(timeout=60)
    assert process.returncode == -9
    assert_holds(root, 1)
    assert_next_checkpointer_recovers(root, survivor=1)


# (failpoint, in which process it kills, which step the root must hold afterwards)
STAGES = [
    pytest.param("learner.checkpoint_write", "worker", 1, id="write"),
    pytest.param("learner.checkpoint_fsync", "worker", 1, id="fsync"),
    pytest.param("learner.checkpoint_before_swap", "trainer", 1, id="rename-before"),
    pytest.param("learner.checkpoint_after_swap", "trainer", 2, id="rename-after"),
    pytest.param("learner.checkpoint_retire", "trainer", 2, id="cleanup"),
]


@pytest.mark.parametrize(("point", "victim", "survivor"), STAGES)
def test_a_save_killed_at_a_stage_leaves_a_complete_checkpoint(
        tmp_path: Path, point: str, victim: str, survivor: int) -> None:
    root = tmp_path / "ckpt"
    committed_step_one(root)
    process = trainer(root, point, "exit")
    out, err = process.communicate(timeout=600)
    if victim == "worker":
        # The trainer lives on and is told; its worker died at the failpoint.
        assert process.returncode == 0, err[-2000:]
        assert f"checkpoint worker died (exit code {CRASH_EXIT})" in out, out + err[-2000:]
    else:
        assert process.returncode == CRASH_EXIT, out + err[-2000:]
    assert_holds(root, survivor)  # what a restarting learner reads first
    assert_next_checkpointer_recovers(root, survivor)

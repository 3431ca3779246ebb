"""Re-saving a step that already has a checkpoint, crashed at every step of the commit.

Each scenario starts a real trainer process that re-saves step 1 through
:class:`AsyncCheckpointer` with one commit failpoint armed to ``exit`` (``os._exit``, as
abrupt as SIGKILL for what is on disk), then checks from the disk alone that step 1 still
has exactly one complete, loadable checkpoint, the old one or the new one as that point
implies, and that the next checkpointer leaves nothing else behind.  Both commit paths are
crashed: the atomic exchange (``renameat2``) and the two-rename fallback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from erlay.actors.learner.checkpoint import (
    AsyncCheckpointer,
    CheckpointSaveFailed,
    latest,
    list_checkpoints,
    load,
)
from erlay.actors.learner.checkpoint import commit as checkpoint_commit
from erlay.actors.learner.checkpoint.format import aside_name, write_checkpoint_dir
from erlay.supervisor import failpoints
from tests.paths import REPO

CRASH_EXIT = 86  # the failpoint's exit code: proves the crash came from the point armed
OLD, NEW = 1.0, 2.0

RESAVE = """
import sys, torch
from erlay.actors.learner.checkpoint import commit as checkpoint_commit
from erlay.actors.learner.checkpoint import AsyncCheckpointer
if sys.argv[2] == "fallback":
    checkpoint_commit._renameat2 = None  # as on a system without RENAME_EXCHANGE
checkpointer = AsyncCheckpointer(sys.argv[1])
checkpointer.save(1, {"w": torch.full((64,), 2.0)}, {"version": "new"})
checkpointer.wait(timeout_s=120)
checkpointer.close()
"""

needs_exchange = pytest.mark.skipif(checkpoint_commit._renameat2 is None,
                                    reason="no renameat2 on this system")

# (commit path, failpoint, whose checkpoint step 1 must hold after the crash)
CRASHES = [
    pytest.param("exchange", "learner.checkpoint_before_swap", OLD, marks=needs_exchange),
    pytest.param("exchange", "learner.checkpoint_after_swap", NEW, marks=needs_exchange),
    pytest.param("exchange", "learner.checkpoint_before_cleanup", NEW, marks=needs_exchange),
    pytest.param("fallback", "learner.checkpoint_before_swap", OLD),
    pytest.param("fallback", "learner.checkpoint_mid_swap", OLD),
    pytest.param("fallback", "learner.checkpoint_after_swap", NEW),
    pytest.param("fallback", "learner.checkpoint_before_cleanup", NEW),
]


def old_checkpoint(root: Path) -> None:
    root.mkdir()
    write_checkpoint_dir(root / "step-00000001", 1, {"w": torch.full((64,), OLD)},
                         {"version": "old"})


def assert_step_one_holds(root: Path, value: float) -> None:
    """Exactly one complete checkpoint, of step 1, with the content of ``value``'s save."""
    found = list_checkpoints(root)
    assert [info.step for info in found] == [1], sorted(p.name for p in root.iterdir())
    state, extra = load(found[0].path)  # checksums verified
    assert extra == {"version": "old" if value == OLD else "new"}
    assert torch.equal(state["w"], torch.full((64,), value))


@pytest.mark.parametrize(("path", "point", "survivor"), CRASHES)
def test_a_resave_crashed_at_any_commit_step_keeps_a_complete_checkpoint(
        tmp_path: Path, path: str, point: str, survivor: float) -> None:
    root = tmp_path / "ckpt"
    old_checkpoint(root)
    env = {**os.environ, failpoints.ENV_VAR: failpoints.env_value(
        {point: {"action": "exit", "exit_code": CRASH_EXIT}})}
    trainer = subprocess.run([sys.executable, "-c", RESAVE, str(root), path], env=env,
                             cwd=REPO, capture_output=True, text=True, timeout=180)
    assert trainer.returncode == CRASH_EXIT, trainer.stderr[-2000:]
    assert_step_one_holds(root, survivor)  # what a restarting learner reads first
    AsyncCheckpointer(root).close()  # the next checkpointer puts the root in order
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]
    assert_step_one_holds(root, survivor)


def test_an_uncrashed_resave_replaces_the_checkpoint_and_leaves_nothing_else(
        tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    old_checkpoint(root)
    trainer = subprocess.run([sys.executable, "-c", RESAVE, str(root), "fallback"], cwd=REPO,
                             capture_output=True, text=True, timeout=180)
    assert trainer.returncode == 0, trainer.stderr[-2000:]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]
    assert_step_one_holds(root, NEW)


def test_an_aside_is_the_checkpoint_only_while_its_step_directory_is_missing(
        tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    old_checkpoint(root)
    write_checkpoint_dir(root / aside_name("step-00000001", "aa"), 1,
                         {"w": torch.full((64,), NEW)}, {"version": "new"})
    assert_step_one_holds(root, OLD)  # the step's own directory wins over a leftover aside
    AsyncCheckpointer(root).close()
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]


def test_an_incomplete_aside_is_never_taken_for_a_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    aside = root / aside_name("step-00000003", "bb")
    write_checkpoint_dir(aside, 3, {"w": torch.ones(4)}, {})
    (aside / "state.pt").write_bytes(b"torn")
    assert list_checkpoints(root) == [] and latest(root) is None
    AsyncCheckpointer(root).close()
    assert list(root.iterdir()) == []


@needs_exchange
def test_exchange_swaps_two_directories_atomically(tmp_path: Path) -> None:
    # Without this, a silent fallback would pass the "exchange" crash scenarios too.
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "from-a").touch()
    (tmp_path / "b").mkdir()
    assert checkpoint_commit.exchange(tmp_path / "a", tmp_path / "b")
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["from-a"]
    assert list((tmp_path / "a").iterdir()) == []


def test_a_commit_failpoint_that_raises_fails_the_save_and_keeps_the_old_checkpoint(
        tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    old_checkpoint(root)
    failpoints.arm("learner.checkpoint_before_swap", "raise")
    try:
        with AsyncCheckpointer(root) as checkpointer:
            checkpointer.save(1, {"w": torch.full((64,), NEW)}, {"version": "new"})
            with pytest.raises(CheckpointSaveFailed, match="failpoint"):
                checkpointer.wait(timeout_s=120)
    finally:
        failpoints.disarm_all()
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]
    assert_step_one_holds(root, OLD)

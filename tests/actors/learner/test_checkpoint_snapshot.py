"""The background snapshot of a checkpoint and its barrier, without Ray.

save() returns before the state's tensors are copied; the caller may modify them only after
the barrier (``wait_snapshot()``, or an optimizer's step through ``guard()``).  These
scenarios hold the copy mid-way with the ``learner.checkpoint_snapshot`` failpoint armed to
``hang`` in this process, so what happens while a snapshot is in progress is deterministic.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
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
from erlay.actors.learner.checkpoint.snapshot import CHUNK_BYTES
from erlay.actors.learner.rank import Learner
from erlay.supervisor import failpoints
from tests.actors.learner.test_checkpoint import assert_same
from tests.actors.learner.test_core import MODEL, arithmetic_batch
from tests.conftest import wait_for

# Two chunks, so a hang after the first leaves the copy half done.
BIG = 2 * CHUNK_BYTES // 4


@contextmanager
def held_snapshot() -> Iterator[None]:
    """Snapshots stop after their first chunk until the failpoint is disarmed, at the latest
    when this exits: enter it inside the checkpointer's block, so that a failing assertion
    releases the copy before close() waits for it."""
    failpoints.arm("learner.checkpoint_snapshot", "hang")
    try:
        yield
    finally:
        failpoints.disarm_all()


def test_a_state_modified_after_the_barrier_is_saved_as_it_was_at_save(
        tmp_path: Path) -> None:
    w = torch.arange(BIG, dtype=torch.float32)
    with AsyncCheckpointer(tmp_path) as checkpointer:
        checkpointer.save(1, {"w": w})
        checkpointer.wait_snapshot()
        w.mul_(-1.0)  # the next optimizer step
        assert checkpointer.wait() == [1]
    assert torch.equal(load(tmp_path / "step-00000001")[0]["w"],
                       torch.arange(BIG, dtype=torch.float32))


def test_a_state_modified_mid_snapshot_fails_the_save_and_is_never_written_torn(
        tmp_path: Path) -> None:
    w = torch.zeros(BIG)
    with AsyncCheckpointer(tmp_path) as checkpointer, held_snapshot():
        checkpointer.save(1, {"w": w})
        # The copy thread records w's version when it starts: modify w only once it holds
        # the copy after the first chunk (under load it may not have started yet).
        wait_for(lambda: failpoints.hits("learner.checkpoint_snapshot") >= 1, timeout=60)
        w.add_(1.0)  # no barrier: half of w is staged before this, half after
        failpoints.disarm("learner.checkpoint_snapshot")
        with pytest.raises(CheckpointSaveFailed, match=r"state\['w'\] was modified in place"):
            checkpointer.wait(timeout_s=120)
        assert list(tmp_path.iterdir()) == []  # the worker wrote nothing
        checkpointer.save(2, {"w": w})  # the next save is whole again
        checkpointer.wait_snapshot()
        assert checkpointer.wait(timeout_s=120) == [2]
    assert [info.step for info in list_checkpoints(tmp_path)] == [2]
    assert torch.equal(load(tmp_path / "step-00000002")[0]["w"], torch.ones(BIG))


def test_a_guarded_optimizer_step_waits_for_the_snapshot(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.ones(BIG))
    optimizer = torch.optim.SGD([param], lr=1.0)
    param.grad = torch.ones(BIG)
    with AsyncCheckpointer(tmp_path) as checkpointer, held_snapshot():
        checkpointer.guard(optimizer)
        checkpointer.save(1, {"param": param.detach()})
        step = threading.Thread(target=optimizer.step, daemon=True)
        step.start()
        step.join(timeout=1.0)
        assert step.is_alive(), "the optimizer stepped while the snapshot was copying"
        assert torch.equal(param.detach(), torch.ones(BIG))
        failpoints.disarm("learner.checkpoint_snapshot")
        step.join()
        assert torch.equal(param.detach(), torch.zeros(BIG))
        assert checkpointer.wait(timeout_s=120) == [1]
    assert torch.equal(load(tmp_path / "step-00000001")[0]["param"], torch.ones(BIG))


def test_the_learner_trains_on_during_a_save_and_its_checkpoint_is_the_saved_step(
        tmp_path: Path) -> None:
    learner = Learner(MODEL, seed=3, checkpoint_dir=str(tmp_path))
    learner.train_step(arithmetic_batch(learner))
    expected = learner.state()
    batch = arithmetic_batch(learner)
    try:
        with held_snapshot():
            saved = learner.save_checkpoint({"journal": "snap-1"})  # returns mid-snapshot
            checkpointer = learner._checkpointer
            assert checkpointer is not None and checkpointer.last_snapshot is not None
            snapshot = checkpointer.last_snapshot
            done_when_stepping: list[bool] = []
            # Runs after the learner's own hook, just before the optimizer moves the weights.
            learner.optimizer.register_step_pre_hook(
                lambda *_: done_when_stepping.append(snapshot.done))
            release = threading.Timer(1.0, failpoints.disarm, ["learner.checkpoint_snapshot"])
            release.start()
            learner.train_step(batch)  # its forward and backward passes overlap the copy
            release.join()
        assert done_when_stepping == [True]
        assert learner.wait_checkpoints() == {"committed": saved["step"], "failed": []}
        assert saved["step"] == 1
    finally:
        learner.erlay_terminate()
    info = latest(tmp_path)
    assert info is not None
    state, extra = load(info.path)
    assert extra == {"journal": "snap-1"}
    assert_same(state, expected)

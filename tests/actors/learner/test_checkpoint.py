"""Asynchronous checkpoints without Ray: round trips of a real learner state, retention,
atomicity after crashes, and failures surfacing from the worker.

Each checkpointer starts nvidia-resiliency-ext's persistent worker (a spawned process that
imports torch, a few seconds here), so scenarios that need a worker are few and whole.
Scenarios that only need a checkpoint on disk write one in-process, with the same writer the
worker uses.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch import distributed as dist

from erlay.actors.learner.checkpoint import (
    AsyncCheckpointer,
    CheckpointInvalid,
    CheckpointSaveFailed,
    ensure_process_group,
    latest,
    list_checkpoints,
    load,
)
from erlay.actors.learner.checkpoint.format import STATE_FILE, write_checkpoint_dir
from tests.actors.learner.test_core import arithmetic_batch, learner, same_weights
from tests.conftest import wait_for
from tests.paths import REPO


class ExplodesInWorker:
    """Pickles in the test process (so save() accepts it) but not in any other process: a
    stand-in for a write that fails in the worker, such as a full disk."""

    def __init__(self, home_pid: int) -> None:
        self.home_pid = home_pid

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        if os.getpid() != self.home_pid:
            raise RuntimeError("disk on fire")
        return ExplodesInWorker, (self.home_pid,)


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Equal structure, equal leaves, and tensors equal in dtype, shape and every value."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def write_uncommitted(directory: Path, step: int, state: dict[str, Any]) -> None:
    """What the worker writes for a save, before finalization renames it into place."""
    write_checkpoint_dir(directory, step, state, {"step": step})


def small_state(value: float) -> dict[str, Any]:
    return {"w": torch.full((4, 3), value), "step": torch.tensor(7.0), "note": ("a", 1)}


# --------------------------------------------------------------------------- round trips
def test_learner_state_round_trips_and_training_continues_identically(tmp_path: Path) -> None:
    a = learner(seed=3)
    a.train_step(arithmetic_batch(a))
    saved = a.state()
    expected = copy.deepcopy(saved)
    next_batch = arithmetic_batch(a)
    with AsyncCheckpointer(tmp_path) as checkpointer:
        checkpointer.save(1, saved, {"journal": "snap-1", "data_position": 8})
        # Once the snapshot has copied the state, the caller may modify it.
        checkpointer.wait_snapshot()
        for tensor in saved["model"].values():
            tensor.zero_()
        # Persisting is in flight (the worker is still starting); nothing is committed yet.
        assert checkpointer.in_flight == 1
        assert latest(tmp_path) is None
        a.train_step(next_batch)  # training goes on meanwhile
        assert checkpointer.wait() == [1]
        assert checkpointer.in_flight is None
    info = latest(tmp_path)
    assert info is not None and info.step == 1
    state, extra = load(info.path)
    assert extra == {"journal": "snap-1", "data_position": 8}
    assert_same(state, expected)  # model, optimizer moments and steps, rng, versions
    b = learner(seed=99)
    b.load_state(state)
    b.train_step(next_batch)
    assert b.version() == a.version()
    assert same_weights(a, b)


def test_back_to_back_saves_commit_in_order_and_only_the_newest_k_remain(
        tmp_path: Path) -> None:
    # Inside a group that already exists, as in a multi-rank learner's process: the
    # checkpointer uses it and leaves it alone.
    assert ensure_process_group()
    try:
        with AsyncCheckpointer(tmp_path, keep=2) as checkpointer:
            for step in (1, 2, 3):
                checkpointer.save(step, small_state(float(step)))  # waits for the previous
            assert checkpointer.wait() == [1, 2, 3]
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
    assert [info.step for info in list_checkpoints(tmp_path)] == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    assert_same(load(tmp_path / "step-00000003")[0], small_state(3.0))


# ---------------------------------------------------------------------------- atomicity
def test_only_complete_checkpoints_count_and_leftovers_are_removed(tmp_path: Path) -> None:
    write_uncommitted(tmp_path / "step-00000001", 1, small_state(1.0))
    # A crash after persisting but before the rename: complete, but never committed.
    write_uncommitted(tmp_path / ".tmp-step-00000004-dead", 4, small_state(4.0))
    # A directory with no manifest, and one whose state file is short.
    (tmp_path / "step-00000003").mkdir()
    (tmp_path / "step-00000003" / STATE_FILE).write_bytes(b"partial")
    write_uncommitted(tmp_path / "step-00000002", 2, small_state(2.0))
    with open(tmp_path / "step-00000002" / STATE_FILE, "r+b") as f:
        f.truncate(100)
    assert [info.step for info in list_checkpoints(tmp_path)] == [1]
    assert latest(tmp_path).step == 1  # type: ignore[union-attr]
    AsyncCheckpointer(tmp_path).close()  # a new start cleans up; it never started a worker
    assert not (tmp_path / ".tmp-step-00000004-dead").exists()
    assert (tmp_path / "step-00000001").exists()


def test_load_rejects_a_checkpoint_whose_bytes_changed(tmp_path: Path) -> None:
    path = tmp_path / "step-00000001"
    write_uncommitted(path, 1, small_state(1.0))
    with open(path / STATE_FILE, "r+b") as f:
        f.seek(-30, os.SEEK_END)
        byte = f.read(1)
        f.seek(-30, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointInvalid, match="sha256"):
        load(path)


# ----------------------------------------------------------------------------- failures
def test_failed_write_surfaces_on_wait_and_leaves_no_checkpoint(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path) as checkpointer:
        checkpointer.save(1, {"w": torch.ones(3), "bad": ExplodesInWorker(os.getpid())})
        with pytest.raises(CheckpointSaveFailed, match="disk on fire") as failure:
            checkpointer.wait()
        assert failure.value.step == 1
        assert list(tmp_path.iterdir()) == []
        checkpointer.save(2, small_state(2.0))  # the worker survived the failure
        assert checkpointer.wait() == [2]
    assert [info.step for info in list_checkpoints(tmp_path)] == [2]


def test_killed_worker_fails_the_save_and_the_next_save_starts_a_new_one(
        tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path) as checkpointer:
        checkpointer.save(1, small_state(1.0))
        checkpointer.wait()
        pid = checkpointer.worker_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                 what="the worker to die")
        checkpointer.save(2, small_state(2.0))
        with pytest.raises(CheckpointSaveFailed, match="worker died") as failure:
            checkpointer.wait(timeout_s=30)
        assert failure.value.step == 2
        assert [info.step for info in list_checkpoints(tmp_path)] == [1]
        assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
        checkpointer.save(3, small_state(3.0))
        assert checkpointer.wait(timeout_s=60) == [3]
        assert checkpointer.worker_pid not in (None, pid)
    assert latest(tmp_path).step == 3  # type: ignore[union-attr]


TRAINER = """
import sys, time, torch
from erlay.actors.learner.checkpoint import AsyncCheckpointer
checkpointer = AsyncCheckpointer(sys.argv[1])
checkpointer.save(1, {"w": torch.ones(8)})
checkpointer.wait()
checkpointer.save(2, {"w": torch.ones(4_000_000)})
print(checkpointer.worker_pid, flush=True)
time.sleep(120)
"""


def test_trainer_killed_mid_save_commits_nothing_and_takes_its_worker_along(
        tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(root)],
                               stdout=subprocess.PIPE, text=True,
                               cwd=REPO)
    try:
        worker = int(trainer.stdout.readline())  # type: ignore[union-attr]
    finally:
        trainer.kill()
        trainer.wait()

    def worker_gone() -> bool:
        try:
            return psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_for(worker_gone, timeout=10, what="the orphaned worker to exit")
    assert [info.step for info in list_checkpoints(root)] == [1]
    AsyncCheckpointer(root).close()  # the next start removes what step 2 left
    assert [p.name for p in root.iterdir()] == ["step-00000001"]


def test_unpicklable_leaf_fails_the_save_and_nothing_reaches_a_worker(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path) as checkpointer:
        checkpointer.save(1, {"w": torch.ones(2), "hook": lambda: None})
        with pytest.raises(CheckpointSaveFailed, match=r"state\['hook'\]: function cannot"):
            checkpointer.wait(timeout_s=60)
        assert checkpointer.in_flight is None
        assert checkpointer.worker_pid is None  # the snapshot never handed it over
    assert list(tmp_path.iterdir()) == []

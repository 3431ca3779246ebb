"""A sharded save killed at each of its stages: a rank's shard write, the manifest, the commit's
renames and retention.

Each scenario starts real rank processes over a root that already holds a committed
checkpoint of step 1 (a replicated one: a root may hold both layouts), saves step 2 through
:class:`ShardedCheckpointer` (``keep=1``) with one stage's failpoint armed in one rank, and
checks from the disk alone that the newest complete checkpoint is step 1's or step 2's as
the stage implies, whole, and that the next checkpointer on that root leaves nothing else.

Failpoints are armed to ``exit`` (``os._exit``: no handler or ``finally`` runs, which for the
disk and for the peers is what SIGKILL leaves, only deterministic), or to ``hang`` and the
process is then SIGKILLed.  A rank whose trainer dies leaves its peers blocked in the next
checkpoint collective; the test kills them, as the learner's one_for_all supervision would.
A rank whose *worker* dies fails the save on every rank, and the ranks live on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from erlay.actors.learner.checkpoint.format import (
    SHARDED,
    latest,
    list_checkpoints,
    load,
    verify_files,
    write_checkpoint_dir,
)
from erlay.actors.learner.checkpoint.sharded import ShardedCheckpointer
from erlay.actors.learner.checkpoint.sharded_load import load_full_model
from erlay.supervisor import failpoints
from tests.actors.learner.test_sharded_checkpoint import free_port
from tests.paths import REPO

CRASH_EXIT = 86  # the failpoint's exit code: proves the crash came from the point armed
SIZE = 200_000

# One rank: its own tensors under rank-specific names, so the checkpoint holds every rank's.
TRAINER = """
import os, sys, torch
from torch import distributed as dist
from erlay.actors.learner.checkpoint import CheckpointSaveFailed
from erlay.actors.learner.checkpoint.sharded import ShardedCheckpointer
root, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=world)
checkpointer = ShardedCheckpointer(root, keep=1, timeout_s=60)
state = {"model": {f"w{rank}": torch.full((SIZE,), 2.0 + rank)},
         "optimizer": {f"m{rank}": torch.full((8,), 2.0)}, "step": 2}
checkpointer.save(2, state, {"v": 2})
print("saved", flush=True)
try:
    checkpointer.wait(timeout_s=120)
    print("committed", flush=True)
except CheckpointSaveFailed as exc:
    print("failed:", exc.reason, flush=True)
checkpointer.close()
dist.destroy_process_group()
""".replace("SIZE", str(SIZE))


def committed_step_one(root: Path) -> None:
    root.mkdir()
    write_checkpoint_dir(root / "step-00000001", 1, {"w": torch.ones(4)}, {"v": 1})


def assert_holds(root: Path, step: int, world: int) -> None:
    """Every ``step-*`` directory is a complete checkpoint, and the newest is ``step``'s,
    whole (checksums verified)."""
    complete = {info.path.name for info in list_checkpoints(root)}
    named = {p.name for p in root.iterdir() if p.name.startswith("step-")}
    assert named == complete, f"half-written: {sorted(named - complete)}"
    info = latest(root)
    assert info is not None and info.step == step, sorted(p.name for p in root.iterdir())
    assert info.extra == {"v": step}
    if step == 1:
        assert torch.equal(load(info.path)[0]["w"], torch.ones(4))
        return
    assert (info.layout, info.world_size) == (SHARDED, world)
    verify_files(info.path, {"files": info.files})
    model = {f"w{rank}": torch.zeros(SIZE) for rank in range(world)}
    load_full_model(info.path, model)
    for rank in range(world):
        assert torch.equal(model[f"w{rank}"], torch.full((SIZE,), 2.0 + rank))


def assert_next_checkpointer_recovers(root: Path, survivor: int, world: int) -> None:
    """Rank 0 of the next checkpointer removes every leftover; the survivor is intact."""
    ShardedCheckpointer(root, keep=1)
    names = sorted(p.name for p in root.iterdir())
    assert all(name.startswith("step-") for name in names), names
    assert_holds(root, survivor, world)


def start(root: Path, world: int, armed: dict[int, dict[str, dict]]
          ) -> list[subprocess.Popen[str]]:
    port = str(free_port())
    processes = []
    for rank in range(world):
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        if rank in armed:
            env[failpoints.ENV_VAR] = failpoints.env_value(armed[rank])
        processes.append(subprocess.Popen(
            [sys.executable, "-c", TRAINER, str(root), str(rank), str(world), port],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return processes


def finish(processes: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    results = []
    for process in processes:
        out, err = process.communicate(timeout=180)
        results.append((process.returncode, out, err[-3000:]))
    return results


def exit_at(point: str) -> dict[str, dict]:
    return {point: {"action": "exit", "exit_code": CRASH_EXIT}}


def test_a_worker_killed_mid_write_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    committed_step_one(root)
    results = finish(start(root, 2, {1: exit_at("learner.checkpoint_write")}))
    for code, out, err in results:
        assert code == 0, err
        assert "failed: 1 rank(s) failed" in out, out + err
    assert f"checkpoint worker died (exit code {CRASH_EXIT})" in results[1][1]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]  # rank 0 cleaned up
    assert_holds(root, 1, 2)


def test_a_rank_sigkilled_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    committed_step_one(root)
    processes = start(root, 2, {1: {"learner.checkpoint_write": {"action": "hang"}}})
    try:
        assert processes[1].stdout.readline().strip() == "saved"  # type: ignore[union-attr]
        # Rank 1's worker hangs once its shard is written, before it reports it.
        tmp = next(p for p in root.iterdir() if p.name.startswith(".tmp-"))
        while not (tmp / "__1_0.distcp").exists():
            assert processes[1].poll() is None
            time.sleep(0.05)
        processes[1].kill()   # the trainer; its worker follows within a second
        processes[1].wait(timeout=60)
    finally:
        processes[0].kill()   # blocked in the agreement: one_for_all restarts it
        for process in processes:
            process.communicate(timeout=60)
    assert processes[1].returncode == -9
    assert_holds(root, 1, 2)
    assert_next_checkpointer_recovers(root, 1, 2)


# (failpoint in rank 0's trainer, rank count, which step the root must hold afterwards)
STAGES = [
    pytest.param("learner.checkpoint_manifest", 2, 1, id="manifest"),
    pytest.param("learner.checkpoint_before_swap", 1, 1, id="rename-before"),
    pytest.param("learner.checkpoint_after_swap", 1, 2, id="rename-after"),
    pytest.param("learner.checkpoint_retire", 1, 2, id="retire"),
]


@pytest.mark.parametrize(("point", "world", "survivor"), STAGES)
def test_rank_zero_killed_at_a_stage_leaves_a_complete_checkpoint(
        tmp_path: Path, point: str, world: int, survivor: int) -> None:
    root = tmp_path / "ckpt"
    committed_step_one(root)
    processes = start(root, world, {0: exit_at(point)})
    code, out, err = finish(processes[:1])[0]
    for peer in processes[1:]:
        peer.kill()  # blocked on rank 0 in the commit's agreement
        peer.communicate(timeout=60)
    assert code == CRASH_EXIT, out + err
    assert_holds(root, survivor, world)  # what a restarting learner reads first
    assert_next_checkpointer_recovers(root, survivor, world)


def test_the_check_catches_a_half_written_step_directory(tmp_path: Path) -> None:
    """The checker of the scenarios above flags what they must never leave: a ``step-*``
    directory whose files do not match its manifest."""
    root = tmp_path / "ckpt"
    committed_step_one(root)
    half = root / "step-00000002"
    write_checkpoint_dir(half, 2, {"w": torch.ones(4)}, {"v": 2})
    with open(half / "state.pt", "ab") as f:
        f.write(b"torn")
    with pytest.raises(AssertionError, match=r"half-written: \['step-00000002'\]"):
        assert_holds(root, 1, 1)

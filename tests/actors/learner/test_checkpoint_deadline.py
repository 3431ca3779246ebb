"""Checkpoint writes under a progress deadline (``checkpoint.deadline_s``).

The deadline itself is pure and is checked with explicit times.  The rest runs real
checkpoint workers and stops them mid-save: SIGSTOP, never continued (``stalled``, the
sharded save), or a write blocked at the ``learner.checkpoint_write`` failpoint (the
learner).  The failpoint reaches the worker through ``ERLAY_FAILPOINTS``, which a worker
reads when it starts, so each scenario arms it only until its worker has started.

Each scenario checks one outcome: the save fails with a reason naming the deadline, the
writer is killed and reaped, the previous checkpoint stays whole with no half-written
directory beside it, the next save commits on a new writer, the learner trains on and
reports the failure in its answer, and close() returns.  Deadlines are 2 s; the only bound
on time is a generous ``BOUND_S`` that turns a hang into a failure instead of a stuck run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch import distributed as dist

from erlay.actors.learner.checkpoint import (
    AsyncCheckpointer,
    CheckpointSaveFailed,
    FailedSaves,
    ensure_process_group,
    latest,
    load,
)
from erlay.actors.learner.checkpoint.format import write_checkpoint_dir
from erlay.actors.learner.checkpoint.worker import ProgressDeadline, WriterSample, writer_sample
from erlay.supervisor import failpoints
from tests.conftest import wait_for

DEADLINE_S = 2.0
BOUND_S = 30.0   # far beyond the deadline: reaching it means the deadline did not act
SIZE = 1_000_000  # floats: 4 MB, a few dozen writes into state.pt


# ------------------------------------------------------------------------ the pure deadline
def test_counters_that_stand_still_expire_at_the_deadline_not_before() -> None:
    watch = ProgressDeadline(DEADLINE_S)
    still = WriterSample((5, 100, 200), "T")
    assert not watch.expired(still, now=10.0)
    assert not watch.expired(still, now=11.99)
    assert watch.expired(still, now=12.0)


def test_any_counter_that_moves_restarts_the_deadline() -> None:
    watch = ProgressDeadline(DEADLINE_S)
    watch.observe(WriterSample((5, 100, 200)), now=10.0)
    assert not watch.expired(WriterSample((5, 100, 201)), now=11.5)  # one byte written
    assert not watch.expired(WriterSample((5, 100, 201)), now=13.0)
    assert watch.expired(WriterSample((5, 100, 201)), now=13.5)


def test_a_runnable_writer_never_expires() -> None:
    watch = ProgressDeadline(DEADLINE_S)
    for now in (0.0, 5.0, 50.0):  # waiting for a CPU is not being stuck
        assert not watch.expired(WriterSample((5, 100, 200), "R"), now=now)


def test_a_stopped_process_shows_no_progress_in_its_samples(tmp_path: Path) -> None:
    """The shell half: the counters of a process that writes move, and freeze once it is
    SIGSTOPped, whose state the sample names."""
    writer = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
    try:
        first = writer_sample(writer.pid, tmp_path)
        assert wait_for(lambda: writer_sample(writer.pid, tmp_path) != first,
                        what="the writer's counters moving")
        os.kill(writer.pid, signal.SIGSTOP)
        wait_for(lambda: psutil.Process(writer.pid).status() == psutil.STATUS_STOPPED)
        frozen = writer_sample(writer.pid, tmp_path)
        threading.Event().wait(0.3)
        later = writer_sample(writer.pid, tmp_path)
        assert later is not None and later == frozen and later.state == "T"
    finally:
        writer.kill()
        writer.wait()
    assert writer_sample(writer.pid, tmp_path) is None  # gone


def test_failed_saves_records_each_failure_and_returns_the_commits() -> None:
    answers: list[Any] = [CheckpointSaveFailed(2, "remembered"),
                          CheckpointSaveFailed(3, "in flight"), [4]]

    def wait() -> list[int]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    failed = FailedSaves()
    assert failed.settle(wait) == [4]
    assert failed.take() == [{"step": 2, "reason": "remembered"},
                             {"step": 3, "reason": "in flight"}]


# ------------------------------------------------------------------------------- helpers
def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((SIZE,), value), "b": torch.full((8,), value)}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_if_alive(pid: int | None) -> None:
    """Cleanup only: a writer the code under test failed to kill must not outlive the test."""
    if pid is not None and alive(pid):
        os.kill(pid, signal.SIGKILL)


@contextmanager
def armed_in_new_workers(spec: dict[str, Any]) -> Iterator[None]:
    """``learner.checkpoint_write`` armed in every checkpoint worker started meanwhile."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(failpoints.ENV_VAR,
                     failpoints.env_value({"learner.checkpoint_write": spec}))
        yield


def stop_mid_save(checkpointer: Any, root: Path, step: int, first_file: str) -> int:
    """Wait until the worker writes the save of ``step`` (``first_file`` exists in its
    temporary directory), SIGSTOP it and return its pid."""
    writer = wait_for(lambda: checkpointer.writer, what="the save reaching its worker")
    assert writer[0] == step
    wait_for(lambda: any(root.glob(f".tmp-step-{step:08d}-*/{first_file}")),
             what="the worker writing")
    os.kill(writer[1], signal.SIGSTOP)
    wait_for(lambda: psutil.Process(writer[1]).status() == psutil.STATUS_STOPPED)
    return int(writer[1])


def returns_within(call: Callable[[], Any], bound_s: float) -> tuple[bool, Any]:
    """Run ``call`` on a thread; ``(returned within bound_s, its value or exception)``."""
    out: list[Any] = [None]

    def run() -> None:
        try:
            out[0] = call()
        except Exception as exc:  # handed to the test to judge
            out[0] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound_s)
    return not thread.is_alive(), out[0]


# ------------------------------------------------- a writer SIGSTOPped mid-save, then more
@dataclass
class Stalled:
    root: Path
    failure: BaseException | None   # what wait() raised for the stalled save
    stopped_pid: int
    stopped_alive: bool             # after the failure
    left: list[str]                 # the root's entries after the failure
    committed: list[int]            # what the next save's wait() returned
    new_pid: int
    close_returned: bool            # close() with the new, idle worker SIGSTOPped
    idle_alive: bool                # that worker, after close()


@pytest.fixture(scope="module")
def stalled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stalled]:
    """Step 1 committed; the save of step 2 SIGSTOPped mid-write (its writes slowed only so
    that the stop lands mid-save); then the save of step 3; then close() with the idle new
    worker SIGSTOPped."""
    root = tmp_path_factory.mktemp("stalled") / "ckpt"
    root.mkdir()
    write_checkpoint_dir(root / "step-00000001", 1, state(1.0), {"v": 1})
    checkpointer = AsyncCheckpointer(root, keep=2, deadline_s=DEADLINE_S)
    stopped = new = None
    try:
        with armed_in_new_workers({"action": "delay", "delay_s": 1.5, "nth": 2}):
            checkpointer.save(2, state(2.0), {"v": 2})
            stopped = stop_mid_save(checkpointer, root, 2, "state.pt")
        failure: BaseException | None = None
        try:
            checkpointer.wait(timeout_s=BOUND_S)
        except (CheckpointSaveFailed, TimeoutError) as exc:
            failure = exc
        stopped_alive, left = alive(stopped), sorted(p.name for p in root.iterdir())
        kill_if_alive(stopped)
        checkpointer.save(3, state(3.0), {"v": 3})
        new = wait_for(lambda: checkpointer.worker_pid, what="a new worker")
        committed = checkpointer.wait(timeout_s=BOUND_S)
        os.kill(new, signal.SIGSTOP)
        returned, _ = returns_within(checkpointer.close, BOUND_S)
        yield Stalled(root, failure, stopped, stopped_alive, left, committed, new, returned,
                      alive(new))
    finally:
        kill_if_alive(stopped)
        kill_if_alive(new)


def test_a_writer_stopped_mid_save_fails_the_save_naming_the_deadline(
        stalled: Stalled) -> None:
    assert isinstance(stalled.failure, CheckpointSaveFailed), stalled.failure
    assert stalled.failure.step == 2
    assert "checkpoint.deadline_s" in stalled.failure.reason, stalled.failure.reason
    assert "stopped (T)" in stalled.failure.reason, stalled.failure.reason


def test_the_stopped_writer_is_killed(stalled: Stalled) -> None:
    assert not stalled.stopped_alive


def test_the_previous_checkpoint_stays_whole_with_nothing_half_written(
        stalled: Stalled) -> None:
    assert stalled.left == ["step-00000001"]
    loaded, extra = load(stalled.root / "step-00000001")  # checksums verified
    assert extra == {"v": 1} and torch.equal(loaded["w"], state(1.0)["w"])


def test_the_next_save_commits_on_a_new_writer(stalled: Stalled) -> None:
    assert stalled.committed == [3]
    assert stalled.new_pid != stalled.stopped_pid
    loaded, extra = load(stalled.root / "step-00000003")
    assert extra == {"v": 3} and torch.equal(loaded["w"], state(3.0)["w"])


def test_close_returns_and_kills_an_idle_stopped_writer(stalled: Stalled) -> None:
    assert stalled.close_returned
    assert not stalled.idle_alive


# --------------------------------------------------------------------- shutdown mid-save
def test_close_with_a_writer_stopped_mid_save_returns_and_kills_it(tmp_path: Path) -> None:
    checkpointer = AsyncCheckpointer(tmp_path, deadline_s=DEADLINE_S)
    pid = None
    try:
        with armed_in_new_workers({"action": "hang", "nth": 2}):
            checkpointer.save(1, state(1.0))
            pid = stop_mid_save(checkpointer, tmp_path, 1, "state.pt")
        returned, raised = returns_within(checkpointer.close, BOUND_S)
        assert returned, "close() waited on a stuck writer past its deadline"
        assert isinstance(raised, CheckpointSaveFailed) and raised.step == 1, raised
        assert not alive(pid)
    finally:
        kill_if_alive(pid)


# --------------------------------------------------------------------------- the learner
def test_the_learner_trains_on_past_a_stalled_save_and_reports_it(tmp_path: Path) -> None:
    """A save whose write blocks: train steps go on (one of their polls gives the writer up,
    and none raises), the next answer lists the failed save, no checkpoint of it exists,
    and the next save commits."""
    from erlay.actors.learner.rank import Learner
    from tests.actors.learner.test_core import MODEL, arithmetic_batch

    learner = Learner(MODEL, seed=3, checkpoint_dir=str(tmp_path),
                      checkpoint_deadline_s=DEADLINE_S)
    pid = None
    try:
        learner.train_step(arithmetic_batch(learner))
        with armed_in_new_workers({"action": "hang", "nth": 2}):
            assert learner.save_checkpoint()["step"] == 1
            pid = wait_for(learner.checkpoint_writer, what="the save's writer")["pid"]
        bound = time.monotonic() + BOUND_S
        while learner.checkpoint_writer() is not None:
            assert time.monotonic() < bound, "no train step gave up the stuck writer"
            learner.train_step(arithmetic_batch(learner))
        assert not alive(pid)
        saved = learner.save_checkpoint()
        assert saved["committed"] is None, saved
        assert [f["step"] for f in saved["failed"]] == [1], saved
        assert "checkpoint.deadline_s" in saved["failed"][0]["reason"], saved
        assert learner.wait_checkpoints() == {"committed": saved["step"], "failed": []}
    finally:
        kill_if_alive(pid)  # first: a planted bug would leave the shutdown waiting on it
        learner.erlay_terminate()
    assert latest(tmp_path).step == saved["step"]  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- sharded
def test_a_sharded_save_whose_writer_is_stopped_fails_and_the_next_commits(
        tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from erlay.actors.learner.checkpoint.sharded import ShardedCheckpointer

    made = ensure_process_group()
    pid = None
    try:
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.AdamW(model.parameters())

        def app_state(step: int) -> dict[str, Any]:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            return {"model": model_sd, "optimizer": optim_sd, "step": step}

        checkpointer = ShardedCheckpointer(tmp_path, deadline_s=DEADLINE_S)
        try:
            # The worker blocks after writing its shard, where the SIGSTOP finds it.
            with armed_in_new_workers({"action": "hang", "nth": 1}):
                checkpointer.save(1, app_state(1))
                pid = stop_mid_save(checkpointer, tmp_path, 1, "__0_0.distcp")
            with pytest.raises(CheckpointSaveFailed, match=r"checkpoint\.deadline_s"):
                checkpointer.wait(timeout_s=BOUND_S)
            assert not alive(pid)
            assert list(tmp_path.iterdir()) == []
            checkpointer.save(2, app_state(2))
            assert checkpointer.wait(timeout_s=BOUND_S) == [2]
        finally:
            kill_if_alive(pid)  # first: a planted bug would leave close() waiting on it
            checkpointer.close()
        assert latest(tmp_path).step == 2  # type: ignore[union-attr]
    finally:
        if made:
            dist.destroy_process_group()


def test_a_sharded_rank_shutting_down_mid_save_kills_its_stopped_writer(
        tmp_path: Path) -> None:
    """abandon(), what a rank's shutdown does with a save in flight (peers are not waited
    for): the writer, stopped mid-save, does not outlive it."""
    from erlay.actors.learner.checkpoint.sharded import ShardedCheckpointer

    made = ensure_process_group()
    pid = None
    try:
        model = torch.nn.Linear(64, 64)
        checkpointer = ShardedCheckpointer(tmp_path, deadline_s=DEADLINE_S)
        with armed_in_new_workers({"action": "hang", "nth": 1}):
            checkpointer.save(1, {"model": model.state_dict(), "optimizer": {}})
            pid = stop_mid_save(checkpointer, tmp_path, 1, "__0_0.distcp")
        returned, _ = returns_within(checkpointer.abandon, BOUND_S)
        assert returned and not alive(pid)
    finally:
        kill_if_alive(pid)
        if made:
            dist.destroy_process_group()

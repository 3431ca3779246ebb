"""Process groups: a keeper kills what it spawned, and never a group whose id was reused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from erlay.supervisor.procs import ProcessKeeper
from erlay.supervisor.reaper import same_group, start_ticks
from tests.conftest import wait_for

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_start_ticks_identify_a_live_process_and_none_for_a_dead_one() -> None:
    proc = subprocess.Popen(SLEEPER)
    try:
        ticks = start_ticks(proc.pid)
        assert ticks is not None and ticks >= start_ticks(os.getpid())  # type: ignore[operator]
        assert same_group(proc.pid, ticks)
        assert not same_group(proc.pid, ticks - 1)  # a different leader: a reused id
    finally:
        proc.kill()
        proc.wait()
    assert start_ticks(proc.pid) is None or not alive(proc.pid)


def test_keeper_kills_its_group_but_not_a_group_that_reused_the_id() -> None:
    keeper = ProcessKeeper()
    try:
        ours = keeper.spawn(SLEEPER)
        keeper.kill_group(ours.pid)
        ours.wait(timeout=10)
        assert ours.returncode == -signal.SIGKILL and not keeper.groups
        # Someone else's group, registered under a stale identity: the keeper must leave it.
        stranger = subprocess.Popen(SLEEPER, start_new_session=True)
        keeper.groups[stranger.pid] = (start_ticks(stranger.pid) or 0) - 1
        assert keeper.signal_group(stranger.pid, signal.SIGKILL) is False
        time.sleep(0.2)
        assert alive(stranger.pid)
        stranger.kill()
        stranger.wait()
    finally:
        keeper.groups.clear()
        keeper.close()


def test_reaper_kills_registered_groups_when_the_host_goes_away() -> None:
    keeper = ProcessKeeper()
    child = keeper.spawn(SLEEPER)
    reaper = keeper._reaper
    assert reaper is not None and reaper.stdin is not None
    reaper.stdin.close()  # what the host's death does
    wait_for(lambda: child.poll() is not None, 10, what="the group killed by the reaper")
    reaper.wait(timeout=10)
    keeper._reaper = None
    keeper.groups.clear()


# A process that adopts its own group, lets a library-like multiprocessing spawn a child
# (not through the keeper), prints both pids, then waits to be killed.
OWN_GROUP_HOST = """
import multiprocessing, os, sys, time
from erlay.supervisor.procs import OwnGroup
group = OwnGroup()
group.keeper.declared_env["ERLAY_TEST_DECLARED"] = "yes"
group.adopt()
if __name__ == "__main__":
    # time.sleep itself as the target: a function defined in this -c script cannot be
    # unpickled by the spawned child, which then died at once, racing the members() below.
    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    proc.start()
    print(os.getpid(), proc.pid, group.members(), flush=True)
    time.sleep(60)
"""


def test_own_group_children_die_with_a_sigkilled_leader() -> None:
    host = subprocess.Popen([sys.executable, "-c", OWN_GROUP_HOST], stdout=subprocess.PIPE,
                            text=True, start_new_session=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        assert host.stdout is not None
        leader, child, members = host.stdout.readline().split(" ", 2)
        leader_pid, child_pid = int(leader), int(child)
        assert os.getpgid(child_pid) == leader_pid, "the spawned child joins the leader's group"
        assert str(child_pid) in members
        with open(f"/proc/{child_pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
        assert b"ERLAY_TEST_DECLARED=yes" in env, "declared variables reach spawned children"
        os.kill(leader_pid, signal.SIGKILL)
        wait_for(lambda: not alive(child_pid), 10, what="the reaper killing the leader's group")
    finally:
        host.kill()
        host.wait(timeout=10)


def test_a_cancelled_subprocess_start_leaves_nothing_running() -> None:
    """Its starter is cancel_safe (a shutdown cancels a restart in progress): cancelled while
    it waits for the child's ready signal, it kills the child's group."""
    import asyncio

    from erlay.supervisor.spec import ChildSpec, SubprocessStart
    from erlay.supervisor.subprocess_child import SubprocessChild

    keeper = ProcessKeeper()
    spawned: list[subprocess.Popen[bytes]] = []
    spawn = keeper.spawn

    def recording_spawn(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        spawned.append(spawn(*args, **kwargs))  # type: ignore[arg-type]
        return spawned[-1]

    keeper.spawn = recording_spawn  # type: ignore[method-assign]

    async def scenario() -> None:
        from erlay.supervisor.runtime import StartContext

        spec = ChildSpec("never-ready", SubprocessStart(SLEEPER, wait_ready=True,
                                                        ready_timeout_s=60))
        ctx = StartContext(spec, "root/never-ready", 1, (), None)  # type: ignore[arg-type]
        start = asyncio.create_task(SubprocessChild.start(ctx, keeper))
        while not spawned:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        start.cancel()
        try:
            await start
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("the start was not cancelled")

    try:
        asyncio.run(scenario())
        spawned[0].wait(timeout=10)
        assert spawned[0].returncode == -signal.SIGKILL
    finally:
        for proc in spawned:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        keeper.close()

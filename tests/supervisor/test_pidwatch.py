"""The pidfd exit watch, with real processes and no Ray: a watched process's exit calls back
on the loop, every callback under a key shares one set of pidfds, no pidfd outlives its use
(the tests count this process's open file descriptors), and a process with exit beacons is
watched through its beacon threads where the kernel allows."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from erlay.supervisor.pidwatch import PIDFD_THREAD, PidWatch, exit_beacons


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run(scenario: Callable[[PidWatch], Awaitable[Any]]) -> Any:
    """Run ``scenario`` with a watch on a fresh loop; the loop's own fds are open already
    when the scenario counts."""
    async def main() -> Any:
        return await scenario(PidWatch(asyncio.get_running_loop()))
    return asyncio.run(main())


async def turns(n: int = 5) -> None:
    """Let the loop run ``n`` turns: what is scheduled ``call_soon`` runs."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_killed_process_calls_back_and_its_pidfd_is_closed(
        sleeper: subprocess.Popen[bytes]) -> None:
    async def scenario(watch: PidWatch) -> tuple[int, int, int]:
        before = open_fds()
        exited = asyncio.Event()
        assert watch.watch("p", sleeper.pid, exited.set) is not None
        watching = watch.watching
        os.kill(sleeper.pid, signal.SIGKILL)
        await asyncio.wait_for(exited.wait(), 10)
        return watching, watch.watching, open_fds() - before

    assert run(scenario) == (1, 0, 0)


def test_callbacks_under_one_key_share_one_pidfd_and_each_is_called_once(
        sleeper: subprocess.Popen[bytes]) -> None:
    async def scenario(watch: PidWatch) -> tuple[int, list[str]]:
        before = open_fds()
        called: list[str] = []
        for name in ("a", "b", "c"):
            watch.watch(("g/e0", 1), sleeper.pid, lambda name=name: called.append(name))
        opened = open_fds() - before
        sleeper.kill()
        sleeper.wait()
        while len(called) < 3:
            await asyncio.sleep(0.01)
        await turns()
        return opened, called

    assert run(scenario) == (1, ["a", "b", "c"])


def test_unwatching_the_last_callback_closes_the_pidfd_and_nothing_is_called(
        sleeper: subprocess.Popen[bytes]) -> None:
    async def scenario(watch: PidWatch) -> tuple[int, int, list[str]]:
        before = open_fds()
        called: list[str] = []
        first = watch.watch("p", sleeper.pid, lambda: called.append("first"))
        second = watch.watch("p", sleeper.pid, lambda: called.append("second"))
        assert first is not None and second is not None
        first.cancel()
        still = open_fds() - before   # the second callback still watches
        second.cancel()
        second.cancel()   # idempotent
        sleeper.kill()
        sleeper.wait()
        await turns()
        return still, open_fds() - before, called

    assert run(scenario) == (1, 0, [])


def test_a_callback_unwatched_after_the_exit_was_seen_is_not_called(
        sleeper: subprocess.Popen[bytes]) -> None:
    async def scenario(watch: PidWatch) -> list[str]:
        called: list[str] = []
        later: list[Any] = []

        def first() -> None:   # runs before the second, and unregisters it
            called.append("first")
            later[0].cancel()

        watch.watch("p", sleeper.pid, first)
        later.append(watch.watch("p", sleeper.pid, lambda: called.append("second")))
        sleeper.kill()
        sleeper.wait()
        while not called:
            await asyncio.sleep(0.01)
        await turns()
        return called

    assert run(scenario) == ["first"]


def test_a_callback_that_raises_does_not_stop_the_others(
        sleeper: subprocess.Popen[bytes]) -> None:
    async def scenario(watch: PidWatch) -> list[str]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)
        called: list[str] = []

        def broken() -> None:
            raise RuntimeError("a bug in one watcher")

        watch.watch("p", sleeper.pid, broken)
        watch.watch("p", sleeper.pid, lambda: called.append("other"))
        sleeper.kill()
        while not called:
            await asyncio.sleep(0.01)
        return called

    assert run(scenario) == ["other"]


def test_a_process_that_already_exited_calls_back_on_the_next_turn() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()   # exited and reaped: no process has its pid now

    async def scenario(watch: PidWatch) -> tuple[int, int, bool]:
        before = open_fds()
        exited = asyncio.Event()
        assert watch.watch("p", gone.pid, exited.set) is not None
        opened = open_fds() - before
        await turns()
        return opened, watch.watching, exited.is_set()

    assert run(scenario) == (0, 0, True)


@pytest.mark.parametrize("missing", ["no os.pidfd_open", "ENOSYS"])
def test_without_pidfds_nothing_is_watched(sleeper: subprocess.Popen[bytes],
                                           monkeypatch: pytest.MonkeyPatch,
                                           missing: str) -> None:
    if missing == "ENOSYS":
        def refused(pid: int) -> int:
            raise OSError(38, "Function not implemented")
        monkeypatch.setattr(os, "pidfd_open", refused)
    else:
        monkeypatch.delattr(os, "pidfd_open")

    async def scenario(watch: PidWatch) -> tuple[object, int, list[str]]:
        called: list[str] = []
        registered = watch.watch("p", sleeper.pid, lambda: called.append("exit"))
        sleeper.kill()
        sleeper.wait()
        await turns()
        return registered, watch.watching, called

    assert run(scenario) == (None, 0, [])


def test_close_closes_every_pidfd_without_calling_back(
        sleeper: subprocess.Popen[bytes]) -> None:
    other = subprocess.Popen(["sleep", "60"])
    try:
        async def scenario(watch: PidWatch) -> tuple[int, int, list[str]]:
            before = open_fds()
            called: list[str] = []
            watch.watch("a", sleeper.pid, lambda: called.append("a"))
            watch.watch("b", other.pid, lambda: called.append("b"))
            opened = open_fds() - before
            watch.close()
            sleeper.kill()
            other.kill()
            sleeper.wait()
            other.wait()
            await turns()
            return opened, open_fds() - before, called

        assert run(scenario) == (2, 0, [])
    finally:
        other.kill()
        other.wait()


# ------------------------------------------------------------------ exit beacons
def thread_pidfds_supported() -> bool:
    try:
        os.close(os.pidfd_open(threading.get_native_id(), PIDFD_THREAD))
    except (AttributeError, OSError):
        return False
    return True


needs_thread_pidfds = pytest.mark.skipif(not thread_pidfds_supported(),
                                         reason="no pidfds for threads (Linux < 6.9)")


def test_exit_beacons_are_two_idle_threads_of_this_process_started_once() -> None:
    tids = exit_beacons()
    assert len(set(tids)) == 2 and exit_beacons() == tids
    assert all(os.path.exists(f"/proc/self/task/{tid}") for tid in tids)


BEACON_CHILD = """
import sys, threading
from erlay.supervisor.pidwatch import exit_beacons
go = threading.Event()
ended = threading.Thread(target=go.wait)   # stands in for a beacon that exits
ended.start()
print(ended.native_id, *exit_beacons(), flush=True)
sys.stdin.readline()
go.set()
ended.join()
sys.stdin.readline()   # the process lives on
"""


@needs_thread_pidfds
def test_a_process_is_watched_through_its_beacon_threads() -> None:
    proc = subprocess.Popen([sys.executable, "-c", BEACON_CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        tids = [int(t) for t in proc.stdout.readline().split()]
        stdin = proc.stdin

        async def scenario(watch: PidWatch) -> tuple[int, bool]:
            before = open_fds()
            exited = asyncio.Event()
            watch.watch("p", proc.pid, exited.set, threads=tids)
            opened = open_fds() - before   # one per thread, none for the process
            stdin.write("end the first thread\n")
            stdin.flush()
            await asyncio.wait_for(exited.wait(), 10)
            return opened, proc.poll() is None

        assert run(scenario) == (3, True)   # seen through a thread, the process still runs
    finally:
        proc.kill()
        proc.wait()


def test_threads_of_another_process_are_not_watched_the_process_is(
        sleeper: subprocess.Popen[bytes]) -> None:
    async def scenario(watch: PidWatch) -> tuple[int, bool]:
        before = open_fds()
        exited = asyncio.Event()
        watch.watch("p", sleeper.pid, exited.set, threads=[threading.get_native_id()])
        opened = open_fds() - before
        sleeper.kill()
        await asyncio.wait_for(exited.wait(), 10)
        return opened, open_fds() == before

    assert run(scenario) == (1, True)


def test_without_pidfds_for_threads_the_process_pidfd_is_watched(
        sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    pidfd_open = os.pidfd_open

    def before_linux_6_9(pid: int, flags: int = 0) -> int:
        if flags:
            raise OSError(22, "Invalid argument")
        return pidfd_open(pid)
    monkeypatch.setattr(os, "pidfd_open", before_linux_6_9)

    async def scenario(watch: PidWatch) -> tuple[int, bool]:
        before = open_fds()
        exited = asyncio.Event()
        watch.watch("p", sleeper.pid, exited.set, threads=exit_beacons())
        opened = open_fds() - before
        sleeper.kill()
        await asyncio.wait_for(exited.wait(), 10)
        return opened, open_fds() == before

    assert run(scenario) == (1, True)


def test_a_forked_child_starts_beacons_of_its_own() -> None:
    parents = exit_beacons()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report its beacons and leave at once
        os.write(write, " ".join(map(str, exit_beacons())).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        childs = [int(t) for t in pipe.read().split()]
    os.waitpid(pid, 0)
    assert len(childs) == 2 and not set(childs) & set(parents)

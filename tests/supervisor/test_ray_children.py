"""Ray-level scenarios: actor children, hosted children, escalation and orphans.

Each test builds a small tree on a real local Ray, injects one fault and asserts on what is
alive afterwards.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from erlay.supervisor.errors import SupervisorFailed
from erlay.supervisor.events import EventKind, MemorySink
from erlay.supervisor.host import host_spec
from erlay.supervisor.raylocal import local_node_id
from erlay.supervisor.spec import (
    ActorStart,
    ChildSpec,
    InProcessStart,
    SubprocessStart,
    SupervisorFlags,
    SupervisorStart,
)
from erlay.supervisor.tree import SupervisionTree
from tests.conftest import wait_for
from tests.supervisor.children import (
    CRASHER,
    FAMILY,
    SLEEPER,
    AsyncEngine,
    DiesAfterStart,
    Echo,
    Engine,
    python,
)

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]
FLAGS = SupervisorFlags("one_for_one", intensity=5, period=10)


def sup(cid: str, *children: ChildSpec, flags: SupervisorFlags = FLAGS) -> ChildSpec:
    return ChildSpec(cid, SupervisorStart(flags, children), type="supervisor")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigkilled_actor_child_is_restarted_and_serves_again() -> None:
    import ray
    sink = MemorySink()
    tree = SupervisionTree("t1", FLAGS, [ChildSpec("engine", ActorStart(Engine)),
                                         ChildSpec("other", ActorStart(AsyncEngine))],
                           sink=sink).start()
    try:
        ref = tree.ref("t1/engine")
        other_pid = ray.get(tree.ref("t1/other").pid.remote())
        pid = ray.get(ref.pid.remote())
        os.kill(pid, signal.SIGKILL)
        new_pid = wait_for(lambda: (p := ray.get(ref.pid.remote(), timeout=5)) != pid and p,
                           what="a new engine incarnation")
        assert new_pid != pid and ref.incarnation == 2
        assert ray.get(ref.inc.remote()) == 1  # a fresh incarnation
        assert ray.get(tree.ref("t1/other").pid.remote()) == other_pid  # one_for_one
        assert [e.child for e in sink.of(EventKind.RESTART)] == ["engine"]
    finally:
        tree.stop()


def test_sigstopped_actor_child_is_detected_by_its_deadline_and_replaced() -> None:
    import ray
    sink = MemorySink()
    spec = ChildSpec("engine", ActorStart(Engine), deadlines={"decode_step": 0.5},
                     progress_poll_s=0.1)
    tree = SupervisionTree("t2", FLAGS, [spec], sink=sink).start()
    try:
        ref = tree.ref("t2/engine")
        pid = ray.get(ref.pid.remote())
        ray.get(ref.hold_work.remote())
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: ray.get(ref.pid.remote(), timeout=2) != pid, 30,
                 what="replacement of the stopped engine")
        hangs = sink.of(EventKind.HANG)
        assert len(hangs) == 1 and hangs[0].child == "engine"
        assert not alive(pid), "the stopped process must be killed, not left behind"
    finally:
        tree.stop()


def test_idle_actor_child_is_never_declared_hung() -> None:
    sink = MemorySink()
    spec = ChildSpec("engine", ActorStart(Engine), deadlines={"decode_step": 0.3},
                     progress_poll_s=0.1)
    tree = SupervisionTree("t3", FLAGS, [spec], sink=sink).start()
    try:
        time.sleep(1.5)
        assert sink.of(EventKind.HANG) == [] and tree.ref("t3/engine").incarnation == 1
    finally:
        tree.stop()


def test_child_crashing_on_every_start_escalates_to_the_root_and_names_it() -> None:
    flags = SupervisorFlags("one_for_one", intensity=1, period=30)
    tree = SupervisionTree("t4", flags, [sup("gen", ChildSpec("bad", ActorStart(DiesAfterStart)),
                                             flags=flags)]).start()
    started = time.monotonic()
    with pytest.raises(SupervisorFailed) as failure:
        tree.wait(timeout=60)
    assert time.monotonic() - started < 30
    assert failure.value.offender == "t4/gen/bad"
    assert "t4/gen/bad" in str(failure.value) and "actor process died" in str(failure.value)
    assert not tree.alive


def test_hosted_crash_loop_escalates_through_the_host_and_leaves_no_process() -> None:
    flags = SupervisorFlags("one_for_one", intensity=1, period=30)
    hosted = (ChildSpec("ok", SubprocessStart(python(SLEEPER), wait_ready=True)),
              ChildSpec("crasher", SubprocessStart(python(CRASHER))))
    sink = MemorySink()
    tree = SupervisionTree("t5", flags, [sup("sandbox", host_spec("n0", flags, hosted,
                                                                  node_id=local_node_id()),
                                             flags=flags)], sink=sink).start()
    with pytest.raises(SupervisorFailed) as failure:
        tree.wait(timeout=60)
    assert failure.value.offender == "t5/sandbox/host@n0/crasher"
    pids = {e.extra["pid"] for e in sink.events if "pid" in e.extra}
    assert pids
    # The escalation kills every group before failing; under load the last exit can still
    # be in flight when wait() returns, so allow it a moment.
    wait_for(lambda: not [p for p in pids if alive(p)], 10, what="every child process gone")


def test_shutting_down_the_tree_leaves_no_orphan_processes() -> None:
    import ray
    hosted = tuple(ChildSpec(f"family-{i}", SubprocessStart(python(FAMILY), wait_ready=True))
                   for i in range(2))
    tree = SupervisionTree("t6", FLAGS, [
        ChildSpec("engine", ActorStart(Engine)),
        sup("pool", host_spec("n0", FLAGS, hosted, node_id=local_node_id())),
    ]).start()
    host = tree.ref("t6/pool/host@n0")
    groups = ray.get(host.process_groups.remote())
    family = [p.pid for g in groups for p in [psutil.Process(g), *psutil.Process(g).children()]]
    actors = [ray.get(tree.ref("t6/engine").pid.remote()), ray.get(host.ping.remote())]
    assert len(family) == 4  # two children, each with a grandchild
    tree.stop()
    wait_for(lambda: not [p for p in family + actors if alive(p)], 15,
             what="every process of the tree gone")


def test_sigkilled_host_takes_its_subprocesses_with_it_and_restarts() -> None:
    import ray
    hosted = (ChildSpec("family", SubprocessStart(python(FAMILY), wait_ready=True)),)
    tree = SupervisionTree("t7", FLAGS, [sup("pool", host_spec("n0", FLAGS, hosted,
                                                               node_id=local_node_id()))]).start()
    try:
        host = tree.ref("t7/pool/host@n0")
        group = ray.get(host.process_groups.remote())[0]
        family = [group] + [p.pid for p in psutil.Process(group).children()]
        host_pid = ray.get(host.ping.remote())
        os.kill(host_pid, signal.SIGKILL)
        wait_for(lambda: not [p for p in family if alive(p)], 15,
                 what="the dead host's subprocesses reaped")
        wait_for(lambda: ray.get(host.ping.remote(), timeout=2) != host_pid, 30,
                 what="a new host")
        new_group = wait_for(lambda: ray.get(host.process_groups.remote(), timeout=2), 30)
        assert new_group and alive(new_group[0])  # type: ignore[index]
    finally:
        tree.stop()


def test_in_process_crash_restarts_inside_the_host() -> None:
    import ray
    sink = MemorySink()
    hosted = (ChildSpec("echo", InProcessStart(Echo)),)
    tree = SupervisionTree("t8", FLAGS, [sup("pool", host_spec("n0", FLAGS, hosted,
                                                               node_id=local_node_id()))],
                           sink=sink).start()
    try:
        host = tree.ref("t8/pool/host@n0")
        with pytest.raises(ray.exceptions.RayTaskError, match="injected"):
            ray.get(host.call.remote("echo", "crash"))
        assert wait_for(lambda: ray.get(host.call.remote("echo", "ping", (4,))) == 4)
        restarts = wait_for(lambda: sink.of(EventKind.RESTART), 5, what="restart event")
        assert restarts[0].path == "t8/pool/host@n0/echo"  # type: ignore[index]
    finally:
        tree.stop()


def test_dynamic_api_on_actor_children() -> None:
    import ray

    from erlay.supervisor.errors import SupervisorCallError
    tree = SupervisionTree("t9", FLAGS, [sup("gen")]).start()
    try:
        assert tree.start_child("t9/gen", ChildSpec("late", ActorStart(Engine))) == "late"
        pid = ray.get(tree.ref("t9/gen/late").pid.remote())
        with pytest.raises(SupervisorCallError, match="already_started"):
            tree.start_child("t9/gen", ChildSpec("late", ActorStart(Engine)))
        tree.terminate_child("t9/gen", "late")
        assert not alive(pid)
        assert tree.count_children("t9/gen") == {"specs": 1, "active": 0, "supervisors": 0,
                                                 "workers": 1}
        tree.restart_child("t9/gen", "late")
        assert ray.get(tree.ref("t9/gen/late").pid.remote()) != pid
        with pytest.raises(SupervisorCallError, match="running"):
            tree.delete_child("t9/gen", "late")
        tree.terminate_child("t9/gen", "late")
        tree.delete_child("t9/gen", "late")
        assert tree.which_children("t9/gen") == []
    finally:
        tree.stop()

"""Frozen children are found by their heartbeat, whatever they are and whoever froze them.

Every scenario freezes a child from outside (``kill -STOP``, or user code that blocks its
event loop), so nothing in the child's own class takes part in the detection.  The heartbeat
is set short (0.4 s x 3) to keep the tests quick; the defaults are 5 s x 3.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from erlay.supervisor.events import EventKind, MemorySink
from erlay.supervisor.health import Health, hang_verdict
from erlay.supervisor.host import host_spec
from erlay.supervisor.raylocal import local_node_id
from erlay.supervisor.spec import (
    ActorStart,
    ChildSpec,
    InProcessStart,
    Liveness,
    SubprocessStart,
    SupervisorFlags,
    SupervisorStart,
)
from erlay.supervisor.tree import SupervisionTree
from tests.conftest import wait_for
from tests.supervisor.children import SLEEPER, BlocksItsLoop, Echo, Engine, python

FLAGS = SupervisorFlags("one_for_one", intensity=5, period=30)
FAST = Liveness(period_s=0.4, misses=3)


# -- the decision, pure ----------------------------------------------------------------------
def test_silence_past_the_liveness_deadline_is_a_hang_naming_phase_and_progress() -> None:
    health = Health(since=0.0, counter=4, phase="decode_step", work="r-7", last_progress=2.0,
                    last_answer=3.0)
    verdict = hang_verdict(health, {}, now=20.0, liveness_s=15.0)
    assert verdict is not None and "no heartbeat answered for 17.0 s" in verdict
    assert "phase decode_step on r-7" in verdict and "last progress 18.0 s ago" in verdict


def test_silence_within_the_deadline_is_not_a_hang() -> None:
    health = Health(since=0.0, last_progress=0.0, last_answer=10.0)
    assert hang_verdict(health, {}, now=20.0, liveness_s=15.0) is None


def test_without_liveness_a_silent_idle_child_is_never_hung() -> None:
    """The planted counterpart: the same silence, no heartbeat configured, no deadlines."""
    health = Health(since=0.0, last_progress=0.0, last_answer=0.0)
    assert hang_verdict(health, {}, now=1000.0, liveness_s=None) is None


def test_every_child_gets_a_heartbeat_by_default() -> None:
    spec = ChildSpec("x", ActorStart(Engine))
    assert spec.liveness == Liveness(5.0, 3) and spec.poll_interval_s == 5.0
    assert spec.liveness.deadline_s == 15.0
    assert ChildSpec("y", ActorStart(Engine), liveness=None).poll_interval_s is None


# -- real processes on a real Ray ------------------------------------------------------------
def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sup(cid: str, *children: ChildSpec) -> ChildSpec:
    return ChildSpec(cid, SupervisorStart(FLAGS, children), type="supervisor")


def hangs(sink: MemorySink, child: str) -> list[str]:
    return [e.reason for e in sink.of(EventKind.HANG) if e.child == child]


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_sigstopped_idle_actor_is_found_by_its_heartbeat_and_restarted() -> None:
    """No deadlines, no work held: only the heartbeat can notice."""
    import ray
    sink = MemorySink()
    tree = SupervisionTree("lv1", FLAGS, [ChildSpec("engine", ActorStart(Engine),
                                                    liveness=FAST)], sink=sink).start()
    try:
        ref = tree.ref("lv1/engine")
        pid = ray.get(ref.pid.remote())
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: ref.incarnation == 2, 30, what="the frozen engine's replacement")
        (reason,) = hangs(sink, "engine")
        assert "no heartbeat answered" in reason and "no work" in reason
        assert ray.get(ref.pid.remote(), timeout=10) != pid
        assert not alive(pid), "the frozen process is killed, not left stopped"
    finally:
        tree.stop()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_user_code_that_blocks_an_async_actors_loop_is_a_hang() -> None:
    import ray
    sink = MemorySink()
    tree = SupervisionTree("lv2", FLAGS, [ChildSpec("worker", ActorStart(BlocksItsLoop),
                                                    liveness=FAST)], sink=sink).start()
    try:
        ref = tree.ref("lv2/worker")
        ref.actor.block.remote()  # never answers: it holds the loop
        wait_for(lambda: ref.incarnation == 2, 30, what="the blocked worker's replacement")
        assert hangs(sink, "worker")
        assert ray.get(ref.actor.ping.remote(), timeout=10) == "pong"
    finally:
        tree.stop()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_sigstopped_host_is_restarted_with_its_children() -> None:
    import ray
    sink = MemorySink()
    hosted = (ChildSpec("echo", InProcessStart(Echo)),
              ChildSpec("proc", SubprocessStart(python(SLEEPER), wait_ready=True)))
    host = host_spec("n0", FLAGS, hosted, node_id=local_node_id())
    host = ChildSpec(host.id, host.start, type="supervisor", shutdown=host.shutdown,
                     liveness=FAST)
    tree = SupervisionTree("lv3", FLAGS, [sup("pool", host)], sink=sink).start()
    try:
        ref = tree.ref("lv3/pool/host@n0")
        host_pid = ray.get(ref.actor.ping.remote())
        groups = ray.get(ref.actor.process_groups.remote())
        os.kill(host_pid, signal.SIGSTOP)
        wait_for(lambda: ref.incarnation == 2, 40, what="the frozen host's replacement")
        assert hangs(sink, "host@n0")
        assert ray.get(ref.actor.call.remote("echo", "ping", (5,)), timeout=10) == 5
        wait_for(lambda: not any(alive(g) for g in groups), 15,
                 what="the frozen host's subprocess gone")
    finally:
        tree.stop()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_sigstopped_hosted_subprocess_is_found_and_restarted() -> None:
    import ray
    sink = MemorySink()
    hosted = (ChildSpec("proc", SubprocessStart(python(SLEEPER), wait_ready=True),
                        liveness=FAST),)
    tree = SupervisionTree("lv4", FLAGS, [sup("pool", host_spec(
        "n0", FLAGS, hosted, node_id=local_node_id()))], sink=sink).start()
    try:
        host = tree.ref("lv4/pool/host@n0")
        rows = ray.get(host.actor.which_children.remote())
        pid = rows[0]["info"]["pid"]
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: ray.get(host.actor.which_children.remote(), timeout=5)[0]
                 ["incarnation"] == 2, 30, what="the stopped subprocess's replacement")
        assert hangs(sink, "proc"), "the host's hang event reaches the tree's sink"
        wait_for(lambda: not alive(pid), 10, what="the stopped subprocess killed")
    finally:
        tree.stop()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_stopping_a_tree_with_a_frozen_host_is_bounded() -> None:
    """The host's shutdown is ``infinity``; a frozen host stops answering its heartbeat, so
    the stop ends anyway, and nothing of it is left."""
    import ray
    slow = Liveness(period_s=0.4, misses=3)
    host = host_spec("n0", FLAGS, (ChildSpec("proc", SubprocessStart(
        python(SLEEPER), wait_ready=True)),), node_id=local_node_id())
    host = ChildSpec(host.id, host.start, type="supervisor", shutdown="infinity",
                     liveness=slow)
    tree = SupervisionTree("lv5", FLAGS, [sup("pool", host)]).start()
    ref = tree.ref("lv5/pool/host@n0")
    host_pid = ray.get(ref.actor.ping.remote())
    os.kill(host_pid, signal.SIGSTOP)
    started = time.monotonic()
    tree.stop(timeout=60)
    assert time.monotonic() - started < 30
    wait_for(lambda: not alive(host_pid), 15, what="the frozen host killed")


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_tree_stop_past_its_timeout_kills_what_is_left_and_never_raises() -> None:
    import ray
    host = host_spec("n0", FLAGS, (ChildSpec("echo", InProcessStart(Echo)),),
                     node_id=local_node_id())
    host = ChildSpec(host.id, host.start, type="supervisor", shutdown="infinity",
                     liveness=None)   # nothing would ever end its shutdown
    tree = SupervisionTree("lv6", FLAGS, [sup("pool", host)]).start()
    host_pid = ray.get(tree.ref("lv6/pool/host@n0").actor.ping.remote())
    os.kill(host_pid, signal.SIGSTOP)
    reason = tree.stop(timeout=3)
    assert reason.kind.value == "killed" and "did not stop within 3 s" in reason.detail
    wait_for(lambda: not alive(host_pid), 15, what="the frozen host killed")


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_hosts_last_events_arrive_before_its_exit() -> None:
    """The host's local supervisor gives up; its child's exits and its escalation must
    reach the tree before the host's own exit, not be lost with the host."""
    flags = SupervisorFlags("one_for_one", intensity=0, period=30)
    hosted = (ChildSpec("crasher", SubprocessStart(python("import sys; sys.exit(3)"))),)
    sink = MemorySink()
    tree = SupervisionTree("lv7", SupervisorFlags("one_for_one", intensity=0, period=30),
                           [sup("pool", host_spec("n0", flags, hosted,
                                                  node_id=local_node_id()))], sink=sink)
    try:
        tree.start()
        tree.wait(timeout=60)
    except Exception:
        pass
    order = [(e.supervisor, e.child, e.context) for e in sink.events]
    host_exit = next(i for i, (s, c, k) in enumerate(order)
                     if c == "host@n0" and k in (EventKind.EXIT, EventKind.ESCALATION))
    crasher_exit = next(i for i, (s, c, k) in enumerate(order)
                        if c == "crasher" and k is EventKind.EXIT)
    inner_escalation = next(i for i, (s, c, k) in enumerate(order)
                            if s.endswith("host@n0") and k is EventKind.ESCALATION)
    assert crasher_exit < host_exit and inner_escalation < host_exit

"""Hosted children restart inside their host: no Ray actor is created for them."""

from __future__ import annotations

import signal

import pytest

from erlay.supervisor.host import host_spec
from erlay.supervisor.raylocal import local_node_id
from erlay.supervisor.spec import ChildSpec, SubprocessStart, SupervisorFlags, SupervisorStart
from erlay.supervisor.tree import SupervisionTree
from tests.conftest import wait_for
from tests.supervisor.children import SLEEPER, python

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_with_dashboard")]


def actor_count() -> int:
    from ray.util.state import list_actors
    return len(list_actors(limit=10_000))  # every actor ever created, dead ones included


def test_crashing_hosted_subprocess_restarts_without_creating_a_ray_actor() -> None:
    import ray
    flags = SupervisorFlags("one_for_one", intensity=10, period=10)
    hosted = tuple(ChildSpec(f"worker-{i}", SubprocessStart(python(SLEEPER), wait_ready=True))
                   for i in range(3))
    tree = SupervisionTree("sa", flags, [ChildSpec("pool", SupervisorStart(flags, (
        host_spec("n0", flags, hosted, node_id=local_node_id()),)), type="supervisor")]).start()
    try:
        host = tree.ref("sa/pool/host@n0")
        before = actor_count()
        old = ray.get(host.process_groups.remote())
        for i in range(3):
            ray.get(host.signal_child.remote(f"worker-{i}", signal.SIGKILL))
        wait_for(lambda: all(r["incarnation"] == 2 and r["status"] == "running"
                             for r in ray.get(host.which_children.remote())), 30,
                 what="all three workers restarted")
        assert not set(old) & set(ray.get(host.process_groups.remote()))
        assert actor_count() == before == 1  # only the host, before and after
    finally:
        tree.stop()

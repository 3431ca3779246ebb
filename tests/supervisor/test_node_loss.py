"""Losing a simulated node restarts that node's host, and its children, on a live node."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from erlay.supervisor.host import host_spec
from erlay.supervisor.spec import ChildSpec, InProcessStart, SupervisorFlags, SupervisorStart
from erlay.supervisor.tree import SupervisionTree
from tests.conftest import wait_for
from tests.supervisor.children import Echo

pytestmark = [pytest.mark.ray, pytest.mark.slow]

FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
               "health_check_timeout_ms": 500, "health_check_initial_delay_ms": 0}


@pytest.fixture
def cluster() -> Iterator[object]:
    import ray
    from ray.cluster_utils import Cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "_system_config": FAST_HEALTH, "include_dashboard": False})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_removed_node_restarts_its_host_and_children_on_a_live_node(cluster: object) -> None:
    import ray
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]  # type: ignore[attr-defined]
    cluster.wait_for_nodes()  # type: ignore[attr-defined]
    ray.init(address=cluster.address, namespace="erlay-test")  # type: ignore[attr-defined]
    flags = SupervisorFlags("one_for_one", intensity=3, period=30)
    hosted = (ChildSpec("echo", InProcessStart(Echo)),)
    hosts = tuple(host_spec(f"n{i}", flags, hosted, node_id=node.node_id)
                  for i, node in enumerate(nodes))
    tree = SupervisionTree("nl", flags, [ChildSpec("pool", SupervisorStart(flags, hosts),
                                                   type="supervisor")]).start()
    try:
        doomed = tree.ref("nl/pool/host@n0")
        survivor = tree.ref("nl/pool/host@n1")
        assert doomed.process.info["node_id"] == nodes[0].node_id
        before = survivor.process.info["pid"]
        cluster.remove_node(nodes[0], allow_graceful=False)  # type: ignore[attr-defined]
        wait_for(lambda: doomed.incarnation == 2 and doomed.process.info["node_id"]
                 != nodes[0].node_id, 60, what="host restarted off the dead node")
        assert doomed.process.info["node_id"] in {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert ray.get(doomed.call.remote("echo", "ping", (9,)), timeout=30) == 9
        assert survivor.process.info["pid"] == before  # the other node's host is untouched
    finally:
        tree.stop()

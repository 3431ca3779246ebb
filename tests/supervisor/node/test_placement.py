"""Placing model-parallel groups inside one NVLink domain: the pure plan, then Ray.

Topologies come from the real-format fixtures (see ``test_topology.py``): GB200 trays of two
racks (two ClusterUUIDs) and DGX H100 nodes (each its own domain)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from erlay.supervisor.node.placement import (
    GpuSlot,
    PlacementError,
    bundle_node_ids,
    bundle_order,
    bundles,
    domain_slots,
    place_group,
    plan_group,
)
from erlay.supervisor.node.topology import NodeTopology, no_gpus, ray_labels, ray_resources
from tests.supervisor.node.test_topology import node

RACK_A = "4e5b2d1c-9a7f-4c3e-8b21-6f0d3a9c7e15"
RACK_B = "0b9e77a2-31c4-4f6d-a8e0-2d5c6e1f9a40"
DOMAIN_A, DOMAIN_B = f"{RACK_A}.32766", f"{RACK_B}.32766"


def two_racks() -> list[NodeTopology]:
    """Four GB200 trays, two per rack.  Rack B sits under the lower switch (``s1.r1``), so its
    domain comes first although its hostnames sort after rack A's."""
    return [node("gb200_nvl72", "gb-a1", "s1.r2.gb-a1", RACK_A),
            node("gb200_nvl72", "gb-a2", "s1.r2.gb-a2", RACK_A),
            node("gb200_nvl72", "gb-b1", "s1.r1.gb-b1", RACK_B),
            node("gb200_nvl72", "gb-b2", "s1.r1.gb-b2", RACK_B)]


def hosts(slots: tuple[GpuSlot, ...] | list[GpuSlot]) -> list[str]:
    return [s.hostname for s in slots]


# ---------------------------------------------------------------- order
def test_bundle_order_is_the_same_for_every_node_order() -> None:
    orders = {tuple(bundle_order(list(p))) for p in itertools.permutations(two_racks())}
    assert len(orders) == 1


def test_bundle_order_is_domain_by_lowest_rank_then_node_rank_then_gpu() -> None:
    slots = bundle_order(two_racks())
    assert [(s.hostname, s.gpu) for s in slots[:5]] == [
        ("gb-b1", 0), ("gb-b1", 1), ("gb-b1", 2), ("gb-b1", 3), ("gb-b2", 0)]
    assert list(domain_slots(two_racks())) == [DOMAIN_B, DOMAIN_A]


def test_ranks_compare_numbers_as_numbers() -> None:
    nodes = [node("dgx_h100", f"dgx-{i}") for i in (10, 2, 1)]
    assert list(dict.fromkeys(hosts(bundle_order(nodes)))) == ["dgx-1", "dgx-2", "dgx-10"]


def test_nodes_without_gpus_take_no_slots() -> None:
    slots = bundle_order([no_gpus("cpu-1", {}), node("dgx_h100", "dgx-1")])
    assert set(hosts(slots)) == {"dgx-1"} and len(slots) == 8


def test_two_nodes_with_one_hostname_are_refused() -> None:
    with pytest.raises(PlacementError, match="two nodes named 'dgx-1'"):
        bundle_order([node("dgx_h100", "dgx-1"), node("dgx_h100", "dgx-1")])


# ---------------------------------------------------------------- one group
def test_a_group_goes_into_one_domain_on_the_first_slots() -> None:
    plan = plan_group(two_racks(), 2)
    assert (plan.domains, hosts(plan.slots), [s.gpu for s in plan.slots]) == (
        (DOMAIN_B,), ["gb-b1", "gb-b1"], [0, 1])
    assert not plan.spans


def test_a_group_of_a_whole_domain_takes_both_trays() -> None:
    plan = plan_group(two_racks(), 8)
    assert plan.domains == (DOMAIN_B,) and hosts(plan.slots) == ["gb-b1"] * 4 + ["gb-b2"] * 4


def test_the_fullest_domain_that_still_fits_is_chosen() -> None:
    taken = bundle_order(two_racks())[:5]  # rack B keeps 3 free, rack A 8
    assert plan_group(two_racks(), 3, taken=taken).domains == (DOMAIN_B,)
    assert plan_group(two_racks(), 4, taken=taken).domains == (DOMAIN_A,)


def test_taken_slots_are_never_planned_again() -> None:
    nodes, taken = two_racks(), list[GpuSlot]()
    for _ in range(8):
        taken.extend(plan_group(nodes, 2, taken=taken).slots)
    assert len(set(taken)) == 16
    with pytest.raises(PlacementError, match="needs more than the 0 free GPUs"):
        plan_group(nodes, 1, taken=taken)


def test_dgx_nodes_are_one_domain_each() -> None:
    nodes = [node("dgx_h100", "dgx-1"), node("dgx_h100", "dgx-2")]
    assert plan_group(nodes, 8).domains == ("node.dgx-1",)
    with pytest.raises(PlacementError, match="fits in no single NVLink domain"):
        plan_group(nodes, 16)


def test_a_group_too_large_for_any_domain_names_sizes_and_domains() -> None:
    with pytest.raises(PlacementError) as err:
        plan_group(two_racks(), 9)
    message = str(err.value)
    assert "group of 9 GPUs" in message
    assert f"{DOMAIN_B}: 8 free of 8" in message and f"{DOMAIN_A}: 8 free of 8" in message
    assert "allow_span=True" in message


def test_allow_span_warns_and_spans_the_fewest_domains(caplog: pytest.LogCaptureFixture) -> None:
    taken = bundle_order(two_racks())[:2]  # rack B: 6 free, rack A: 8
    with caplog.at_level(logging.WARNING, logger="erlay.placement"):
        plan = plan_group(two_racks(), 10, taken=taken, allow_span=True)
    assert plan.spans and plan.domains == (DOMAIN_B, DOMAIN_A)
    assert hosts(plan.slots) == ["gb-b1", "gb-b1", "gb-a1", "gb-a1", "gb-a1", "gb-a1",
                                 "gb-a2", "gb-a2", "gb-a2", "gb-a2"]
    assert [r.getMessage() for r in caplog.records if "SPANS 2 NVLink domains" in r.getMessage()]


def test_a_group_larger_than_the_cluster_fails_even_when_spanning_is_allowed() -> None:
    with pytest.raises(PlacementError, match="group of 17 GPUs needs more than the 16"):
        plan_group(two_racks(), 17, allow_span=True)


def test_an_empty_group_is_refused() -> None:
    with pytest.raises(PlacementError, match="size 0"):
        plan_group(two_racks(), 0)


def test_bundles_pin_the_domain_and_the_host() -> None:
    plan = plan_group(two_racks(), 2)
    assert bundles(plan, gpu_resource="fake_gpu", extra={"CPU": 0.5}) == [
        {"fake_gpu": 1.0, f"nvlink_domain_{DOMAIN_B}": 1.0, "gpu_host_gb-b1": 1.0,
         "CPU": 0.5}] * 2


# ---------------------------------------------------------------- on Ray
@pytest.fixture
def two_rack_cluster() -> Iterator[dict[str, str]]:
    """A loopback Ray cluster whose four nodes carry the two racks' resources and labels,
    registered in a shuffled order (the head is one of them).  Yields hostname -> node id.
    No GPUs here: ``fake_gpu`` stands in for Ray's ``GPU``."""
    import ray
    from ray.cluster_utils import Cluster

    import erlay.supervisor.raylocal  # noqa: F401 - sets the loopback-only variable before Ray
    if ray.is_initialized():
        ray.shutdown()
    by_host = {t.hostname: t for t in two_racks()}
    shuffled = [by_host[h] for h in ("gb-a2", "gb-b1", "gb-a1", "gb-b2")]

    def args(t: NodeTopology) -> dict[str, Any]:
        return {"num_cpus": 1, "num_gpus": 0, "node_ip_address": "127.0.0.1",
                "resources": {**ray_resources(t), "fake_gpu": float(len(t.gpus))},
                "labels": ray_labels(t)}

    cluster = Cluster(initialize_head=True,
                      head_node_args={**args(shuffled[0]), "include_dashboard": False})
    node_ids = {shuffled[0].hostname: cluster.head_node.node_id}  # type: ignore[attr-defined]
    try:
        for t in shuffled[1:]:
            node_ids[t.hostname] = cluster.add_node(**args(t)).node_id
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="erlay-test")
        yield node_ids
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_groups_land_in_one_nvlink_domain_on_a_ray_cluster(
        two_rack_cluster: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    import ray

    host_of = {nid: h for h, nid in two_rack_cluster.items()}
    labels = {n["NodeID"]: n.get("Labels", {}) for n in ray.nodes()}
    assert labels[two_rack_cluster["gb-a1"]].get("erlay.io/nvlink-domain") == DOMAIN_A

    # A group of two: both bundles on the planned tray of rack B, whatever order Ray saw.
    plan, pg = place_group(list(reversed(two_racks())), 2, name="tp-0", gpu_resource="fake_gpu")
    assert plan == plan_group(two_racks(), 2)
    placed = [host_of[nid] for nid in bundle_node_ids(pg)]
    assert placed == hosts(plan.slots) == ["gb-b1", "gb-b1"]

    # Too large for one domain: refused before Ray is asked.
    with pytest.raises(PlacementError, match="group of 9 GPUs fits in no single"):
        place_group(two_racks(), 9, taken=plan.slots, gpu_resource="fake_gpu")

    # Allowed to span: a warning, and Ray puts each bundle where the plan says.
    with caplog.at_level(logging.WARNING, logger="erlay.placement"):
        wide, wide_pg = place_group(two_racks(), 9, taken=plan.slots, allow_span=True,
                                    name="ep-0", gpu_resource="fake_gpu")
    assert any("SPANS 2 NVLink domains" in r.getMessage() for r in caplog.records)
    placed = [host_of[nid] for nid in bundle_node_ids(wide_pg)]
    assert placed == hosts(wide.slots)
    assert placed.count("gb-a1") == 4 and placed.count("gb-a2") == 4
    assert {"gb-b1", "gb-b2"} & set(placed)
    ray.util.remove_placement_group(wide_pg)
    ray.util.remove_placement_group(pg)

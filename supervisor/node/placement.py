"""Placing a model-parallel group (tensor or expert parallel) inside one NVLink domain.

A group of ``k`` ranks talks all-to-all every layer; over NVLink that is cheap, over the
inter-node network it is not.  So a group goes into one NVLink domain or, unless the caller
allows spanning, does not go anywhere: never a silent span.

The pure core:

- :func:`bundle_order` lists every GPU slot in one deterministic order, by (lowest topology
  rank in the slot's domain, the node's topology rank, GPU index); hostnames break ties.
  It depends on the nodes' topologies only, never on the order Ray registered them in.
- :func:`plan_group` picks the domain and the slots for one group: the domain with the fewest
  free GPUs that still holds the group (best fit, so large domains stay whole for large
  groups), ties to the earlier domain; inside it, the first ``k`` free slots in bundle order
  (which keeps a node's NUMA-local GPUs together).  If no domain holds the group it raises
  :class:`PlacementError`, or with ``allow_span=True`` logs a warning and spans as few domains
  as it can.

The Ray shell, :func:`create_placement_group`, turns a plan into a placement group of one
bundle per GPU.  Each bundle asks for one GPU, one unit of ``nvlink_domain_<domain>`` and one
unit of ``gpu_host_<hostname>`` (registered per node, see :mod:`erlay.supervisor.node.topology`), so
Ray puts bundle ``i`` on the planned node and can never move it out of the planned domain.  Ray
still chooses which of that node's GPUs a bundle gets (``CUDA_VISIBLE_DEVICES``); the plan's
GPU index is the intended one, and the count per node is exact.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from erlay.supervisor.errors import ErlayError
from erlay.supervisor.node.topology import NodeTopology, TopoRank, domain_resource, host_resource

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

log = logging.getLogger("erlay.placement")


class PlacementError(ErlayError):
    """A group cannot be placed as asked: it fits in no one NVLink domain (and spanning was
    not allowed), the cluster lacks the GPUs, or Ray did not place the bundles in time."""


@dataclass(frozen=True)
class GpuSlot:
    """One GPU as a place for one rank: its NVLink domain, node and index on the node."""

    domain: str
    hostname: str
    gpu: int


@dataclass(frozen=True)
class GroupPlacement:
    """Where one group goes: bundle (rank) ``i`` on ``slots[i]``.  ``domains`` lists the
    domains used in bundle order; more than one only for an allowed span."""

    slots: tuple[GpuSlot, ...]
    domains: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.slots)

    @property
    def spans(self) -> bool:
        return len(self.domains) > 1


# ------------------------------------------------------------------------ pure core
def _node_key(node: NodeTopology) -> tuple[TopoRank, str]:
    return node.topo_rank, node.hostname


def bundle_order(nodes: Sequence[NodeTopology]) -> list[GpuSlot]:
    """Every GPU of ``nodes`` in the deterministic bundle order (see the module docstring).

    Nodes without GPUs contribute nothing.  Raises :class:`PlacementError` when two nodes
    share a hostname (their resources would collide in Ray)."""
    seen: set[str] = set()
    for node in nodes:
        if node.hostname in seen:
            raise PlacementError(f"two nodes named {node.hostname!r}; hostnames must be unique")
        seen.add(node.hostname)
    # A node with GPUs always has a domain; the pairs keep the type checker from doubting it.
    with_gpus = [(n.nvlink_domain, n) for n in nodes if n.gpus and n.nvlink_domain]
    first_in_domain: dict[str, tuple[TopoRank, str]] = {}
    for domain, node in with_gpus:
        key = _node_key(node)
        if domain not in first_in_domain or key < first_in_domain[domain]:
            first_in_domain[domain] = key
    ordered = sorted(with_gpus, key=lambda dn: (first_in_domain[dn[0]], _node_key(dn[1])))
    return [GpuSlot(domain, n.hostname, g.index)
            for domain, n in ordered for g in sorted(n.gpus, key=lambda g: g.index)]


def domain_slots(nodes: Sequence[NodeTopology]) -> dict[str, list[GpuSlot]]:
    """The slots of each NVLink domain, domains and slots in bundle order."""
    by_domain: dict[str, list[GpuSlot]] = {}
    for slot in bundle_order(nodes):
        by_domain.setdefault(slot.domain, []).append(slot)
    return by_domain


def plan_group(nodes: Sequence[NodeTopology], size: int, *,
               taken: Collection[GpuSlot] = frozenset(),
               allow_span: bool = False) -> GroupPlacement:
    """Choose the domain and slots for a model-parallel group of ``size`` ranks.

    ``taken`` are slots other groups already hold.  Deterministic: the same nodes (in any
    order) and ``taken`` give the same placement.  Raises :class:`PlacementError` when the
    group fits in no single domain and ``allow_span`` is false, naming the size and every
    domain's free and total GPUs; with ``allow_span`` it logs a warning and spans the fewest
    domains (those with the most free GPUs first).  A group larger than all free GPUs always
    raises."""
    if size < 1:
        raise PlacementError(f"a group needs at least one rank, got size {size}")
    everything = domain_slots(nodes)
    taken_set = set(taken)
    free = {d: [s for s in slots if s not in taken_set] for d, slots in everything.items()}
    order = list(everything)
    fitting = [d for d in order if len(free[d]) >= size]
    if fitting:
        domain = min(fitting, key=lambda d: (len(free[d]), order.index(d)))
        return GroupPlacement(tuple(free[domain][:size]), (domain,))
    summary = ", ".join(f"{d}: {len(free[d])} free of {len(everything[d])}" for d in order)
    summary = summary or "no GPUs at all"
    total = sum(len(slots) for slots in free.values())
    if total < size:
        raise PlacementError(f"a group of {size} GPUs needs more than the {total} free GPUs "
                             f"in the cluster (per NVLink domain: {summary})")
    if not allow_span:
        raise PlacementError(f"a model-parallel group of {size} GPUs fits in no single "
                             f"NVLink domain (per domain: {summary}); allow_span=True would "
                             "span domains over the slower inter-node network")
    return _span(size, order, free, summary)


def _span(size: int, order: list[str], free: Mapping[str, list[GpuSlot]],
          summary: str) -> GroupPlacement:
    """Fewest domains: take the domains with the most free GPUs first, then restore bundle
    order so ranks that share a domain stay adjacent."""
    chosen: list[GpuSlot] = []
    for domain in sorted(order, key=lambda d: (-len(free[d]), order.index(d))):
        chosen.extend(free[domain][:size - len(chosen)])
        if len(chosen) == size:
            break
    position = {d: i for i, d in enumerate(order)}
    chosen.sort(key=lambda s: position[s.domain])  # stable: keeps bundle order inside one
    domains = tuple(dict.fromkeys(s.domain for s in chosen))
    log.warning("placement: a model-parallel group of %d GPUs SPANS %d NVLink domains (%s); "
                "its collectives cross the inter-node network (per domain: %s)", size,
                len(domains), ", ".join(domains), summary)
    return GroupPlacement(tuple(chosen), domains)


def bundles(placement: GroupPlacement, *, gpu_resource: str = "GPU",
            extra: Mapping[str, float] | None = None) -> list[dict[str, float]]:
    """One Ray bundle per slot: one ``gpu_resource``, one unit of the slot's domain resource
    and one of its host resource, plus ``extra`` (e.g. ``{"CPU": 1}``).  ``gpu_resource`` is
    ``"GPU"`` on real clusters; tests without GPUs pass a custom slot resource."""
    return [{gpu_resource: 1.0, domain_resource(s.domain): 1.0,
             host_resource(s.hostname): 1.0, **(extra or {})} for s in placement.slots]


# ------------------------------------------------------------------------ Ray shell
def create_placement_group(placement: GroupPlacement, *, name: str = "",
                           gpu_resource: str = "GPU", extra: Mapping[str, float] | None = None,
                           timeout_s: float = 60.0) -> PlacementGroup:
    """Create the placement group for ``placement`` and wait until Ray has placed it.

    Raises :class:`PlacementError` (after removing the group) if it is not placed within
    ``timeout_s``: a planned node is gone or its GPUs are held by a group the plan did not
    know about."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles(placement, gpu_resource=gpu_resource, extra=extra),
                         strategy="PACK", name=name)
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        hosts = sorted({s.hostname for s in placement.slots})
        raise PlacementError(f"placement group {name or '(unnamed)'} of {placement.size} "
                             f"GPUs on {', '.join(hosts)} was not placed within {timeout_s} s; "
                             "a node is gone or its GPUs are held by another group")
    return pg


def place_group(nodes: Sequence[NodeTopology], size: int, *,
                taken: Collection[GpuSlot] = frozenset(), allow_span: bool = False,
                name: str = "", gpu_resource: str = "GPU",
                extra: Mapping[str, float] | None = None,
                timeout_s: float = 60.0) -> tuple[GroupPlacement, PlacementGroup]:
    """:func:`plan_group`, then :func:`create_placement_group`."""
    placement = plan_group(nodes, size, taken=taken, allow_span=allow_span)
    return placement, create_placement_group(placement, name=name, gpu_resource=gpu_resource,
                                             extra=extra, timeout_s=timeout_s)


def bundle_node_ids(pg: PlacementGroup) -> list[str]:
    """The Ray node id (hex) of each bundle, in bundle order, from Ray's placement group
    table."""
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)["bundles_to_node_id"]
    return [table[i] for i in range(len(table))]


def bundle_strategy(pg: PlacementGroup, index: int) -> Any:
    """The scheduling strategy that runs an actor (rank ``index``) in bundle ``index``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg,
                                            placement_group_bundle_index=index)

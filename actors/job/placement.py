"""Colocated placement: one Ray placement group whose bundle ``i`` holds learner rank ``i`` and
engine ``i`` (``placement.colocate``; docs/scaling.md, "Colocated placement").

The driver reserves the group once, before the tree is built, and removes it when the job
ends.  Every child spec of a pair names its bundle, so a restart of either child (a new
actor from the same spec) lands in the same bundle, beside the same partner: the two stay
two processes and two fault domains on one device.  Without ``colocate`` the job gets
:data:`SPREAD_OUT`, a placement that changes no option and owns no group (a null object:
the driver never asks whether there is one).

A bundle holds ``placement.bundle_cpus`` CPUs and, where the pair asks for GPUs,
``learner.num_gpus + engine.vllm.num_gpus`` of them; on a CPU-only machine the same group
is made with CPU bundles only, so CI runs this placement as a GPU node would.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from erlay.actors.config import JobConfig
from erlay.supervisor.errors import ErlayError

log = logging.getLogger("erlay.job")


class PlacementUnavailable(ErlayError):
    """The placement group's resources were not granted within ``placement.ready_timeout_s``
    (the cluster lacks them, or they are held by something else); nothing was started."""


def bundles(cfg: JobConfig) -> list[dict[str, float]]:
    """The resources of each (learner rank, engine) pair's bundle, rank order.

    >>> from erlay.actors.config import load_config
    >>> bundles(load_config(None, ["placement.colocate=true"]))
    [{'CPU': 1.0}]
    """
    gpus = cfg.learner.num_gpus + (cfg.engine.vllm.num_gpus if cfg.engine.backend == "vllm"
                                   else 0.0)
    bundle = {"CPU": cfg.placement.bundle_cpus, **({"GPU": gpus} if gpus > 0 else {})}
    return [dict(bundle) for _ in range(cfg.learner.num_ranks)]


def vllm_engine_args(cfg: JobConfig) -> dict[str, Any]:
    """``engine.vllm.engine_args``, with vLLM's sleep mode on when colocated (its sleep and
    wake-up need the engine's memory allocated through vLLM's sleep-mode allocator)."""
    args = dict(cfg.engine.vllm.engine_args)
    if cfg.placement.colocate:
        args["enable_sleep_mode"] = True
    return args


@dataclass(frozen=True)
class Placement:
    """Where the learner ranks and engines go.  ``group`` is the reserved placement group
    (None: no colocation); :meth:`learner` and :meth:`engine` add bundle ``i``'s scheduling
    strategy to a child's Ray options."""

    group: Any = None   # ray.util.placement_group.PlacementGroup

    def learner(self, rank: int, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` of learner rank ``rank``, in its pair's bundle when colocated."""
        return self._in_bundle(rank, options)

    def engine(self, index: int, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` of engine ``index``, in its pair's bundle when colocated."""
        return self._in_bundle(index, options)

    def _in_bundle(self, index: int, options: dict[str, Any]) -> dict[str, Any]:
        if self.group is None:
            return options
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        return {**options, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=index)}

    def remove(self) -> None:
        """Give the group's resources back (the end of the job); never raises."""
        if self.group is None:
            return
        from ray.util.placement_group import remove_placement_group
        try:
            remove_placement_group(self.group)
        except Exception:   # Ray may be going down already; the job ends anyway
            log.warning("the colocation placement group was not removed", exc_info=True)


SPREAD_OUT = Placement()
"""No colocation: Ray places every child where it fits."""


def reserve(cfg: JobConfig) -> Placement:
    """The job's placement: with ``placement.colocate``, one placement group of
    :func:`bundles`, granted within ``placement.ready_timeout_s`` (else it is removed and
    :class:`PlacementUnavailable` raised); without, :data:`SPREAD_OUT`."""
    if not cfg.placement.colocate:
        return SPREAD_OUT
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    wanted = bundles(cfg)
    group = placement_group(wanted, strategy=cfg.placement.strategy,
                            name=f"erlay-colocate-{cfg.run.name}")
    timeout_s = cfg.placement.ready_timeout_s
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as exc:
        remove_placement_group(group)
        raise PlacementUnavailable(
            f"the colocation placement group ({len(wanted)} x {wanted[0]}, "
            f"{cfg.placement.strategy}) was not granted within {timeout_s:g} s "
            f"(placement.ready_timeout_s); the cluster has {ray.cluster_resources()}: "
            f"{type(exc).__name__}") from None
    log.info("colocated placement: %d bundle(s) of %s, %s", len(wanted), wanted[0],
             cfg.placement.strategy)
    return Placement(group)

"""The node runtime of a job: what every node gets before the tree starts, and at the end.

Before the tree starts, :func:`prepare_nodes` runs one task on every alive node (pinned to
it, no CPU) that

- seeds the node's JIT and compile caches from the shared archive, in one sequential
  extraction (:class:`erlay.supervisor.node.jitcache.JitCache`; ``node.jit_cache``),
- reports the node's stack versions (:func:`erlay.supervisor.node.versions.stack_versions`) and its
  topology (:func:`erlay.supervisor.node.topology.discover`: GPUs and NVLink domain),

and the driver fails fast, with a table of what differs, if the nodes' versions differ
(``node.check_versions``), before any component starts.

Every actor of the job gets :func:`actor_env` in its ``runtime_env``: the declared
environment (``node.env`` and the driver's values of ``node.env_passthrough``), the cache
directories, and ``ERLAY_NUMA_BIND`` (each GPU worker then binds itself to its GPU's local
CPUs and memory, see :mod:`erlay.supervisor.actor_child`).  Node hosts forward the declared
environment to every process they spawn, and those to theirs.

At the end, :func:`finish_nodes` asks every node to archive its caches; one elected node
writes the archive (every node compiled the same kernels).  With KV hand-off
(``engine.kv_handoff``), the node runtime also owns each node's directory of saved KV
caches (:class:`HandoffDir`): made before the tree starts, removed at the end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from erlay.actors.config import NodeSection
from erlay.supervisor.actor_child import INIT_ENV
from erlay.supervisor.node.numa import NUMA_ENV
from erlay.supervisor.node.versions import capture_env, check_consistent, stack_versions

log = logging.getLogger("erlay.node")


@dataclass(frozen=True)
class NodeReport:
    """What one node said before the tree started."""

    node: str                     # node-<i>, as the job labels hosts
    hostname: str
    versions: dict[str, str | None]
    gpus: int
    nvlink_domain: str | None
    seed: str                     # the JIT cache seed's status (seeded, missing, ...) or off
    topology_error: str | None = None


def declared_env(cfg: NodeSection, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The declared environment: the driver's values of ``env_passthrough``, then ``env``."""
    return {**capture_env(cfg.env_passthrough, environ), **cfg.env}


def _jit_spec(cfg: NodeSection) -> Any:
    if cfg.jit_cache.archive_dir is None:
        return None
    from erlay.supervisor.node.jitcache import CacheSpec
    return CacheSpec(archive_dir=Path(cfg.jit_cache.archive_dir),
                     local_root=Path(cfg.jit_cache.local_dir))


def actor_env(cfg: NodeSection, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every actor of the job gets (see the module docstring)."""
    env = declared_env(cfg, environ)
    spec = _jit_spec(cfg)
    if spec is not None:
        from erlay.supervisor.node.jitcache import cache_env
        env.update(cache_env(spec.local_root, spec.extra, spec.flags))
    if cfg.numa_bind:
        env[NUMA_ENV] = "1"
        env[INIT_ENV] = "erlay.supervisor.node.numa:bind_from_env"
    return env


@dataclass(frozen=True)
class HandoffDir:
    """The node-local directory of a run's saved KV caches (engine.kv_handoff): made on
    every node before the tree starts, removed at the end
    (:mod:`erlay.actors.engine.kv_handoff`)."""

    root: str
    run_id: str
    owner: dict[str, Any]

    @property
    def path(self) -> str:
        return str(Path(self.root) / self.run_id)


def _prepare(label: str, spec: Any, handoff: HandoffDir | None = None) -> NodeReport:
    """On one node: seed its caches, make the run's KV hand-off directory, report its
    versions and topology."""
    import socket

    from erlay.supervisor.node.topology import TopologyError, discover
    seed = "off"
    if spec is not None:
        from erlay.supervisor.node.jitcache import JitCache
        result = JitCache(spec).seed()
        seed = result.status + (f" ({result.files} files)" if result.files else "")
    if handoff is not None:
        from erlay.actors.engine.kv_handoff import prepare_run_dir
        prepare_run_dir(Path(handoff.root), handoff.run_id, handoff.owner)
    try:
        topo = discover()
        gpus, domain, error = len(topo.gpus), topo.nvlink_domain, None
    except TopologyError as exc:  # reported, and the job goes on without topology
        gpus, domain, error = 0, None, str(exc)
    return NodeReport(label, socket.gethostname(), stack_versions(), gpus, domain, seed, error)


def _archive(label: str, spec: Any, run_id: str) -> str | None:
    """On one node: stand for election as the run's archiver; write the archive if elected."""
    from erlay.supervisor.node.jitcache import JitCache
    cache = JitCache(spec)
    path = cache.archive(cache.elect(run_id))
    return None if path is None else str(path)


def _on_each_node(nodes: list[str], fn: Any, *args: Any, timeout_s: float) -> list[Any]:
    """``fn(label, *args)`` on each node of ``nodes`` (pinned there), in order."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = [task.options(name=f"erlay/node@node-{i}:{fn.__name__.strip('_')}",
                         scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(f"node-{i}", *args) for i, node in enumerate(nodes)]
    return ray.get(refs, timeout=timeout_s)


def gather_reports(cfg: NodeSection, nodes: list[str], timeout_s: float = 300.0,
                   handoff: HandoffDir | None = None) -> list[NodeReport]:
    """One :class:`NodeReport` per node id in ``nodes`` (in order, labelled node-<i>)."""
    return _on_each_node(nodes, _prepare, _jit_spec(cfg), handoff, timeout_s=timeout_s)


def prepare_nodes(cfg: NodeSection, nodes: list[str], handoff: HandoffDir | None = None
                  ) -> list[NodeReport]:
    """Seed, report and check every node (see the module docstring).  Raises
    :class:`~erlay.supervisor.errors.VersionMismatch`, whose message is the table, when the nodes'
    versions differ and ``check_versions`` is on."""
    reports = gather_reports(cfg, nodes, handoff=handoff)
    for report in reports:
        log.info("%s (%s): %d GPU(s), NVLink domain %s, JIT cache %s", report.node,
                 report.hostname, report.gpus, report.nvlink_domain, report.seed)
        if report.topology_error:
            log.warning("%s: topology not known: %s", report.node, report.topology_error)
    driver = {"driver": stack_versions()}
    if cfg.check_versions:
        check_consistent({**driver, **{r.node: r.versions for r in reports}})
    return reports


def _remove_handoff(label: str, root: str, run_id: str) -> bool:
    from erlay.actors.engine.kv_handoff import remove_run_dir
    return remove_run_dir(Path(root), run_id)


def remove_handoff(nodes: list[str], handoff: HandoffDir | None) -> None:
    """Remove the run's KV hand-off directory on every node.  Never raises: a job that
    ended keeps its result."""
    if handoff is None:
        return
    try:
        _on_each_node(nodes, _remove_handoff, handoff.root, handoff.run_id, timeout_s=60.0)
    except Exception:
        log.warning("removing the KV hand-off caches of %s failed on some node",
                    handoff.run_id, exc_info=True)


def finish_nodes(cfg: NodeSection, nodes: list[str], run_id: str,
                 handoff: HandoffDir | None = None) -> list[str]:
    """Remove the run's KV hand-off directory on every node; offer every node's caches for
    the archive, which the elected node writes.  Returns the archives written (one,
    normally).  Never raises: a job that ended keeps its result."""
    if handoff is not None:
        try:
            _on_each_node(nodes, _remove_handoff, handoff.root, handoff.run_id,
                          timeout_s=60.0)
        except Exception:
            log.warning("removing the KV hand-off caches of %s failed on some node",
                        handoff.run_id, exc_info=True)
    spec = _jit_spec(cfg)
    if spec is None:
        return []
    try:
        written = _on_each_node(nodes, _archive, spec, run_id, timeout_s=600.0)
    except Exception:
        log.warning("JIT cache archiving failed", exc_info=True)
        return []
    return [w for w in written if w is not None]

"""The node runtime: the declared environment, JIT caches seeded per node before the tree
starts and archived by one node at the end, and a job that stops before any work when its
nodes' versions differ."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from erlay.actors.config import NodeSection, load_config
from erlay.actors.job import node_runtime
from erlay.actors.job.driver import Job
from erlay.actors.rundir import RunDir
from erlay.supervisor.node.jitcache import CacheSpec, JitCache
from erlay.supervisor.node.versions import stack_versions
from erlay.supervisor.raylocal import alive_nodes
from tests.paths import REPO

CONFIGS = REPO / "configs"


def test_declared_env_takes_the_driver_values_then_the_configured_ones() -> None:
    cfg = NodeSection(env={"NCCL_DEBUG": "WARN", "MY_FLAG": "1"},
                      env_passthrough=["LD_LIBRARY_PATH", "NCCL_*"])
    environ = {"LD_LIBRARY_PATH": "/opt/cuda/lib64", "NCCL_DEBUG": "INFO",
               "NCCL_IB_HCA": "mlx5", "HOME": "/root"}
    assert node_runtime.declared_env(cfg, environ) == {
        "LD_LIBRARY_PATH": "/opt/cuda/lib64", "NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "mlx5",
        "MY_FLAG": "1"}


def test_actor_env_adds_the_caches_and_numa_binding(tmp_path: Path) -> None:
    cfg = NodeSection.model_validate({"env_passthrough": [], "jit_cache": {
        "archive_dir": str(tmp_path / "shared"), "local_dir": str(tmp_path / "local")}})
    env = node_runtime.actor_env(cfg, {})
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "local" / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "local" / "triton")
    assert env["ERLAY_NUMA_BIND"] == "1"
    off = NodeSection(env_passthrough=[], numa_bind=False)
    assert node_runtime.actor_env(off, {}) == {}


@pytest.mark.ray
def test_each_node_reports_and_seeds_its_caches(tmp_path: Path, ray_local: None) -> None:
    shared, built, fresh = tmp_path / "shared", tmp_path / "built", tmp_path / "fresh"
    builder = JitCache(CacheSpec(archive_dir=shared, local_root=built))
    builder.seed()
    (built / "inductor" / "fx").mkdir(parents=True)
    (built / "inductor" / "fx" / "graph.bin").write_bytes(b"compiled" * 100)
    assert builder.archive(builder.elect("build-run")) is not None
    cfg = NodeSection.model_validate({"jit_cache": {"archive_dir": str(shared),
                                                    "local_dir": str(fresh)}})
    nodes = sorted(n["NodeID"] for n in alive_nodes())
    (report,) = node_runtime.prepare_nodes(cfg, nodes)
    assert report.node == "node-0" and report.gpus == 0 and report.topology_error is None
    assert report.versions == stack_versions()
    assert report.seed == "seeded (1 files)"
    assert (fresh / "inductor" / "fx" / "graph.bin").read_bytes() == b"compiled" * 100
    # At the end one node (of one, here) is elected and writes the archive back.
    (fresh / "inductor" / "fx" / "more.bin").write_bytes(b"x")
    written = node_runtime.finish_nodes(cfg, nodes, "the-run")
    assert written == [str(builder.archive_path)]


@pytest.mark.ray
def test_a_job_whose_nodes_differ_stops_before_anything_starts(
        tmp_path: Path, fresh_ray: None, monkeypatch: pytest.MonkeyPatch) -> None:
    real = node_runtime.gather_reports

    def with_an_older_node(cfg: NodeSection, nodes: list[str],
                           handoff: node_runtime.HandoffDir | None = None
                           ) -> list[node_runtime.NodeReport]:
        (here,) = real(cfg, nodes, handoff=handoff)
        other = replace(here, node="node-1", versions={**here.versions, "torch": "2.12.0"})
        return [here, other]
    monkeypatch.setattr(node_runtime, "gather_reports", with_an_older_node)
    cfg = load_config(CONFIGS / "cpu.yaml", ["run.steps=2", "ray.num_cpus=4"])
    job = Job(cfg, RunDir.create(tmp_path, "mismatch"))
    result = job.run(progress=False)
    assert result.status == "failed"
    assert "nothing was started" in result.reason and "torch" in result.reason
    assert "2.12.0" in result.reason and "node-1" in result.reason
    assert job.tree is None and not job.run_dir.read_metrics()
    assert "2.12.0" in job.run_dir.summary.read_text()
    handoff = job.handoff_dir()
    assert handoff is not None and not Path(handoff.path).exists(), \
        "the KV hand-off directory made before the check is gone"

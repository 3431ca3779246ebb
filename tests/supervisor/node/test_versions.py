"""Version consistency: per-process reports, the node x package comparison, and a gather
from real Ray actors."""

from __future__ import annotations

import platform

import pytest

from erlay.supervisor.errors import VersionMismatch
from erlay.supervisor.node.versions import (
    MismatchRow,
    capture_env,
    check_consistent,
    mismatch_table,
    stack_versions,
    version_mismatches,
)

BASE = {"python": "3.11.7", "torch": "2.13.0", "ray": "2.60.0", "vllm": None}


class VersionProbe:
    """Stands in for a node host: reports the stack of its process."""

    def stack_versions(self) -> dict[str, str | None]:
        return stack_versions()


def test_stack_versions_reports_the_stack_without_a_gpu() -> None:
    found = stack_versions()
    assert found["python"] == platform.python_version()
    assert found["platform"] == platform.machine()
    assert found["ray"] and found["torch"] and found["erlay"]
    assert found["nccl"] is None  # CPU-only torch, no NCCL wheel
    assert {"vllm", "flashinfer"} <= set(found)


def test_equal_reports_have_no_mismatch() -> None:
    assert version_mismatches({"node-0": BASE, "node-1": dict(BASE)}) == []
    check_consistent({"node-0": BASE, "node-1": dict(BASE)})


def test_a_differing_version_and_a_missing_package_are_both_mismatches() -> None:
    node1 = {**BASE, "torch": "2.12.1", "vllm": "0.33.0"}
    node2 = {k: v for k, v in BASE.items() if k != "ray"}
    rows = version_mismatches({"node-0": BASE, "node-1": node1, "node-2": node2})
    assert rows == [
        MismatchRow("ray", {"node-0": "2.60.0", "node-1": "2.60.0", "node-2": None}),
        MismatchRow("torch", {"node-0": "2.13.0", "node-1": "2.12.1", "node-2": "2.13.0"}),
        MismatchRow("vllm", {"node-0": None, "node-1": "0.33.0", "node-2": None}),
    ]
    assert version_mismatches({"a": BASE, "b": node1}, ignore={"torch", "vllm"}) == []


def test_table_has_a_column_per_node_and_marks_what_is_missing() -> None:
    table = mismatch_table([MismatchRow("vllm", {"node-0": None, "node-1": "0.33.0"})])
    assert table.splitlines() == ["package  node-0     node-1",
                                  "vllm     (missing)  0.33.0"]
    assert mismatch_table([]) == ""


def test_capture_env_takes_declared_names_and_globs_only() -> None:
    environ = {"NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "mlx5", "CUDA_HOME": "/usr/local/cuda",
               "HOME": "/root", "MY_NCCL": "x"}
    assert capture_env(["NCCL_*", "CUDA_HOME", "LD_LIBRARY_PATH"], environ) == {
        "NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "mlx5", "CUDA_HOME": "/usr/local/cuda"}


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_versions_gathered_from_actors_fail_on_a_node_with_another_torch() -> None:
    import ray

    from erlay.supervisor.node.versions import gather_versions
    probe = ray.remote(num_cpus=0)(VersionProbe)
    actors = {"node-0": probe.remote(), "node-2": probe.remote()}
    try:
        by_node = gather_versions(actors)
    finally:
        for actor in actors.values():
            ray.kill(actor)  # type: ignore[arg-type]
    assert by_node["node-0"] == by_node["node-2"] == stack_versions()
    check_consistent(by_node)
    by_node["node-1"] = {**by_node["node-0"], "torch": "2.0.0"}
    with pytest.raises(VersionMismatch) as mismatch:
        check_consistent(by_node)
    torch = by_node["node-0"]["torch"]
    assert [row.package for row in mismatch.value.rows] == ["torch"]
    header, row = mismatch.value.table.splitlines()
    assert header.split() == ["package", "node-0", "node-1", "node-2"]
    assert row.split() == ["torch", torch, "2.0.0", torch]
    assert mismatch.value.table in str(mismatch.value)

"""Topology discovery: parsing real-format ``nvidia-smi`` output, and what Ray is told.

Fixtures under ``fixtures/topology/`` follow the tools' real output: a GB200 NVL72 compute tray
(4 GPUs, fabric ClusterUUID/CliqueId, two Grace sockets), a DGX H100 (8 GPUs, the all-zero
ClusterUUID H100 NVSwitch systems report, two Xeon sockets) and a machine without
``nvidia-smi`` (``no_gpu_shell.txt`` records what its shell says)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from erlay.supervisor.node.topology import (
    NodeTopology,
    TopologyError,
    affinity_map,
    build_topology,
    discover,
    format_cpulist,
    no_gpus,
    parse_cpulist,
    parse_smi_q,
    parse_topo_m,
    ray_labels,
    ray_resources,
    ray_start_args,
    topo_rank,
)

FIXTURES = Path(__file__).parent / "fixtures" / "topology"
GB200_CLUSTER = "4e5b2d1c-9a7f-4c3e-8b21-6f0d3a9c7e15"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def node(kind: str, hostname: str, addr: str | None = None,
         cluster_uuid: str = GB200_CLUSTER) -> NodeTopology:
    """A topology parsed from a fixture (``gb200_nvl72`` or ``dgx_h100``), on ``hostname``;
    GB200 trays of another rack get another ``cluster_uuid``."""
    smi = fixture(f"{kind}_smi_q.txt").replace(GB200_CLUSTER, cluster_uuid)
    env = {"SLURM_TOPOLOGY_ADDR": addr} if addr else {}
    return build_topology(hostname, parse_smi_q(smi), parse_topo_m(fixture(f"{kind}_topo_m.txt")),
                          env)


def runner(outputs: Mapping[str, subprocess.CompletedProcess[str] | BaseException]):
    """A fake ``run``: the outcome per command (``"-q"`` or ``"topo"``); records calls."""
    calls: list[list[str]] = []

    def run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        calls.append(list(argv))
        outcome = outputs[argv[1]]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    run.calls = calls  # type: ignore[attr-defined]
    return run


def done(stdout: str, rc: int = 0, stderr: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["nvidia-smi"], rc, stdout=stdout, stderr=stderr)


# ---------------------------------------------------------------- real machines
def test_gb200_tray_is_in_its_fabric_nvlink_domain_with_grace_affinity() -> None:
    topo = node("gb200_nvl72", "gb-r1-t06", "s1.r1.gb-r1-t06")
    assert topo.nvlink_domain == f"{GB200_CLUSTER}.32766"
    assert [g.bus_id for g in topo.gpus] == ["00000008:01:00.0", "00000009:01:00.0",
                                             "00000018:01:00.0", "00000019:01:00.0"]
    assert {(g.cluster_uuid, g.clique_id) for g in topo.gpus} == {(GB200_CLUSTER, 32766)}
    assert [format_cpulist(g.cpus) for g in topo.gpus] == ["0-71", "0-71", "72-143", "72-143"]
    assert [format_cpulist(g.numa) for g in topo.gpus] == ["0,2-17", "0,2-17",
                                                           "1,18-33", "1,18-33"]
    assert all(g.uuid.startswith("GPU-") for g in topo.gpus)


def test_dgx_h100_all_zero_cluster_uuid_makes_the_node_its_own_domain() -> None:
    topo = node("dgx_h100", "dgx-07")
    assert topo.nvlink_domain == "node.dgx-07"
    assert len(topo.gpus) == 8 and all(g.cluster_uuid is None for g in topo.gpus)
    assert format_cpulist(topo.gpus[3].cpus) == "0-55,112-167"
    assert format_cpulist(topo.gpus[4].cpus) == "56-111,168-223"
    assert [g.numa for g in topo.gpus] == [(0,)] * 4 + [(1,)] * 4


def test_fabric_reported_as_na_means_no_multi_node_domain() -> None:
    text = (fixture("dgx_h100_smi_q.txt")
            .replace(": Completed", ": N/A").replace(": Success", ": N/A")
            .replace("CliqueId" + " " * 26 + ": 0", "CliqueId" + " " * 26 + ": N/A")
            .replace(": 00000000-0000-0000-0000-000000000000", ": N/A"))
    assert {(g.cluster_uuid, g.clique_id) for g in parse_smi_q(text)} == {(None, None)}


def test_no_fabric_section_at_all_means_no_multi_node_domain() -> None:
    lines = fixture("dgx_h100_smi_q.txt").splitlines()
    kept, skipping = [], False
    for line in lines:  # an older driver prints no Fabric section
        if line == "    Fabric":
            skipping = True
        elif skipping and not line.startswith("        "):
            skipping = False
        if not skipping:
            kept.append(line)
    assert all(g.cluster_uuid is None for g in parse_smi_q("\n".join(kept)))


def test_state_fields_under_other_headings_are_not_read_as_fabric() -> None:
    text = fixture("gb200_nvl72_smi_q.txt").replace(
        "    Inforom Version\n", "    Inforom Version\n        State                             "
        ": In Progress\n        CliqueId                          : 7\n")
    assert {g.clique_id for g in parse_smi_q(text)} == {32766}


# ---------------------------------------------------------------- malformed output
def test_fabric_still_registering_is_an_error_not_a_guess() -> None:
    text = fixture("gb200_nvl72_smi_q.txt").replace("State                             : "
                                                    "Completed", "State                "
                                                    "             : In Progress", 1)
    with pytest.raises(TopologyError) as err:
        parse_smi_q(text)
    line = text.splitlines().index("        State                             : In Progress")
    assert (err.value.tool, err.value.line, err.value.got) == ("nvidia-smi -q", line + 1,
                                                               "In Progress")
    assert "Completed" in err.value.expected


def test_failed_fabric_registration_is_an_error() -> None:
    text = fixture("gb200_nvl72_smi_q.txt").replace(": Success", ": Failure", 1)
    with pytest.raises(TopologyError, match=r"Status 'Success'.*Failure"):
        parse_smi_q(text)


def test_smi_q_cut_between_gpus_is_an_error_naming_the_count() -> None:
    text = fixture("gb200_nvl72_smi_q.txt")
    cut = text[:text.index("GPU 00000018:01:00.0")]
    with pytest.raises(TopologyError, match=r"expected 4 GPU sections.*got '2 sections"):
        parse_smi_q(cut)


def test_smi_q_cut_inside_the_fabric_section_is_an_error() -> None:
    text = fixture("gb200_nvl72_smi_q.txt")
    last_fabric = text.rindex("        CliqueId")
    with pytest.raises(TopologyError, match=r"ClusterUUID in the Fabric section.*no CliqueId"):
        parse_smi_q(text[:last_fabric])


def test_smi_q_without_a_gpu_uuid_is_an_error() -> None:
    text = "\n".join(line for line in fixture("dgx_h100_smi_q.txt").splitlines()
                     if "GPU UUID" not in line or "GPU-" not in line or "9A" in line)
    with pytest.raises(TopologyError, match="'GPU UUID' line"):
        parse_smi_q(text)


def test_output_that_is_not_smi_q_is_an_error() -> None:
    with pytest.raises(TopologyError, match="expected an 'Attached GPUs : <n>' line"):
        parse_smi_q(fixture("no_gpu_shell.txt"))
    with pytest.raises(TopologyError, match="line 25: expected 'GPU <bus id>'"):
        parse_smi_q(fixture("dgx_h100_topo_m.txt"))


def test_topo_m_cut_before_the_last_gpu_row_is_an_error() -> None:
    text = fixture("dgx_h100_topo_m.txt")
    with pytest.raises(TopologyError, match="no row for GPU7"):
        parse_topo_m(text[:text.index("\nGPU7\t") + 1])


def test_topo_m_row_cut_mid_line_is_an_error_naming_the_line() -> None:
    text = fixture("gb200_nvl72_topo_m.txt")
    cut = text[:text.index("\nGPU3\t") + 20]
    with pytest.raises(TopologyError) as err:
        parse_topo_m(cut)
    assert (err.value.tool, err.value.line) == ("nvidia-smi topo -m", 5)


def test_topo_m_row_with_a_missing_cell_is_an_error() -> None:
    text = fixture("gb200_nvl72_topo_m.txt").replace("GPU1\tNV18\t X \t", "GPU1\t X \t")
    with pytest.raises(TopologyError, match="'X' in column GPU1"):
        parse_topo_m(text)


def test_topo_m_bad_cpu_list_is_an_error() -> None:
    text = fixture("gb200_nvl72_topo_m.txt").replace("\t72-143\t", "\t72-1x3\t", 1)
    with pytest.raises(TopologyError, match="72-1x3"):
        parse_topo_m(text)


def test_topo_m_with_spaces_instead_of_tabs_is_rejected() -> None:
    with pytest.raises(TopologyError, match="tab-separated header"):
        parse_topo_m(fixture("dgx_h100_topo_m.txt").expandtabs(8))


def test_topo_m_of_an_old_driver_without_numa_column_has_no_numa_affinity() -> None:
    old = ("\tGPU0\tGPU1\tmlx5_0\tCPU Affinity\n"
           "GPU0\t X \tNV1\tPHB\t0-7\nGPU1\tNV1\t X \tPHB\t0-7\nmlx5_0\tPHB\tPHB\t X \t\n\n"
           "Legend:\n\n  X    = Self\n")
    assert [(a.cpus, a.numa) for a in parse_topo_m(old)] == [(tuple(range(8)), ())] * 2


def test_tools_disagreeing_on_the_gpu_count_is_an_error() -> None:
    smi = parse_smi_q(fixture("gb200_nvl72_smi_q.txt"))
    with pytest.raises(TopologyError, match="4 GPU rows"):
        build_topology("n", smi, parse_topo_m(fixture("dgx_h100_topo_m.txt")), {})


def test_gpus_of_one_node_in_two_partitions_is_an_error() -> None:
    text = fixture("gb200_nvl72_smi_q.txt").replace(": 32766", ": 1", 1)
    with pytest.raises(TopologyError, match="one NVLink partition"):
        build_topology("n", parse_smi_q(text), parse_topo_m(fixture("gb200_nvl72_topo_m.txt")),
                       {})


# ---------------------------------------------------------------- discover
def test_discover_without_nvidia_smi_is_a_machine_without_gpus() -> None:
    assert "command not found" in fixture("no_gpu_shell.txt")
    run = runner({"-q": FileNotFoundError(2, "No such file or directory: 'nvidia-smi'")})
    topo = discover(run, env={}, hostname="cpu-3")
    assert (topo.gpus, topo.nvlink_domain, topo.topo_addr) == ((), None, "cpu-3")
    assert ray_resources(topo) == {}
    assert "erlay.io/nvlink-domain" not in ray_labels(topo)


def test_discover_with_nvidia_smi_finding_no_devices_is_a_machine_without_gpus() -> None:
    topo = discover(runner({"-q": done("No devices were found\n", rc=6)}), env={},
                    hostname="cpu-4")
    assert topo.gpus == ()


def test_discover_with_a_failing_nvidia_smi_is_an_error() -> None:
    msg = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
           "Make sure that the latest NVIDIA driver is installed and running.")
    with pytest.raises(TopologyError, match="exit status 9: NVIDIA-SMI has failed"):
        discover(runner({"-q": done(msg, rc=9)}), env={}, hostname="gpu-1")


def test_discover_with_a_hung_nvidia_smi_is_an_error() -> None:
    hung = subprocess.TimeoutExpired(["nvidia-smi", "topo", "-m"], 60)
    run = runner({"-q": done(fixture("dgx_h100_smi_q.txt")), "topo": hung})
    with pytest.raises(TopologyError, match="nvidia-smi topo -m: expected an answer"):
        discover(run, env={}, hostname="gpu-1")


def test_discover_reads_both_tools_and_the_slurm_topology_address() -> None:
    run = runner({"-q": done(fixture("gb200_nvl72_smi_q.txt")),
                  "topo": done(fixture("gb200_nvl72_topo_m.txt"))})
    topo = discover(run, env={"SLURM_TOPOLOGY_ADDR": "s1.s3.node12"}, hostname="node12")
    assert run.calls == [["nvidia-smi", "-q"], ["nvidia-smi", "topo", "-m"]]  # type: ignore[attr-defined]
    assert topo == node("gb200_nvl72", "node12", "s1.s3.node12")
    assert topo.topo_rank == ("s", 1, ".s", 3, ".node", 12, "")


def test_without_slurm_the_hostname_is_the_topology_address() -> None:
    topo = node("dgx_h100", "dgx-10")
    assert (topo.topo_addr, topo.topo_rank) == ("dgx-10", ("dgx-", 10, ""))


# ---------------------------------------------------------------- small pure parts
def test_topo_rank_sorts_numbers_as_numbers() -> None:
    addrs = ["s1.s10.node1", "s1.s3.node12", "s1.s3.node2", "s2.s1.node1"]
    assert sorted(addrs, key=topo_rank) == ["s1.s3.node2", "s1.s3.node12", "s1.s10.node1",
                                            "s2.s1.node1"]


def test_cpulists_round_trip_and_reject_garbage() -> None:
    assert parse_cpulist("0-2,5,7-8") == (0, 1, 2, 5, 7, 8)
    assert format_cpulist(parse_cpulist("0-55,112-167")) == "0-55,112-167"
    assert parse_cpulist("N/A") == () and format_cpulist(()) == "N/A"
    for bad in ("", "3-1", "0-", "a"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


# ---------------------------------------------------------------- what Ray is told
def test_ray_resources_count_the_gpus_of_the_domain_and_the_host() -> None:
    topo = node("gb200_nvl72", "gb-r1-t06")
    assert ray_resources(topo) == {f"nvlink_domain_{GB200_CLUSTER}.32766": 4.0,
                                   "gpu_host_gb-r1-t06": 4.0}
    assert ray_labels(topo) == {"erlay.io/topo-addr": "gb-r1-t06",
                                "erlay.io/host": "gb-r1-t06",
                                "erlay.io/nvlink-domain": f"{GB200_CLUSTER}.32766"}


def test_ray_start_args_parse_with_rays_own_parsers() -> None:
    from ray._private.label_utils import parse_node_labels_string

    topo = node("gb200_nvl72", "gb-r1-t06", "s1.r1.gb-r1-t06")
    flags = ray_start_args(topo)
    assert flags[0::2] == ["--resources", "--labels"]
    assert json.loads(flags[1]) == ray_resources(topo)
    assert parse_node_labels_string(flags[3]) == ray_labels(topo)


def test_a_label_value_ray_would_reject_is_an_error() -> None:
    topo = node("dgx_h100", "dgx-07", "s1." + "x" * 70)
    with pytest.raises(TopologyError, match=r"erlay.io/topo-addr"):
        ray_labels(topo)


def test_affinity_map_gives_each_gpu_its_cpus_and_cpu_memory_node() -> None:
    assert affinity_map(node("gb200_nvl72", "gb-1"))[2] == {"cpus": "72-143", "numa": 1}
    assert affinity_map(node("dgx_h100", "dgx-1"))[0] == {"cpus": "0-55,112-167", "numa": 0}
    assert affinity_map(no_gpus("cpu-1", {})) == {}

"""What one machine looks like to a placement decision: its GPUs, their NVLink domain, their
CPU and NUMA affinity, and where the machine sits in the cluster's network.

Sources, all read-only:

- ``nvidia-smi -q``: each GPU's PCI bus id, UUID and its ``Fabric`` section.  On GB200-class
  systems (multi-node NVLink, "MNNVL") every GPU reports the ``ClusterUUID`` and ``CliqueId``
  of the NVLink partition it belongs to; GPUs with the same pair talk over NVLink, across
  trays.  Elsewhere the section is absent (older drivers), ``N/A``, or, on H100 NVSwitch
  systems, ``Completed`` with an all-zero ClusterUUID; then the node itself is the NVLink
  domain.
- ``nvidia-smi topo -m``: each GPU's CPU affinity (``0-55,112-167``) and NUMA affinity.
- ``SLURM_TOPOLOGY_ADDR`` (``s1.s3.node12``, the switches above the node, then the node) when
  the job runs under Slurm's topology plugin; otherwise the hostname.

Contracts:

- Parsing is pure (:func:`parse_smi_q`, :func:`parse_topo_m`, :func:`build_topology`);
  :func:`discover` only adds the calls to the tools.
- Malformed, truncated or inconsistent output raises :class:`TopologyError` naming the tool,
  the line and what was expected.  Nothing is guessed: a fabric that is still registering is
  an error, not "no fabric".
- A machine without ``nvidia-smi`` is a machine without GPUs: an explicit topology with
  ``gpus == ()`` and ``nvlink_domain is None``, not an error.  So is ``nvidia-smi`` reporting
  "No devices were found" (logged as a warning: GPUs can also fall off the bus).
- GPU ``index`` is the order of the GPU sections in ``nvidia-smi -q``: nvidia-smi lists GPUs in
  PCI bus order, the same order as its ``-i`` indices and ``topo -m``'s ``GPU<n>``.
- :func:`topo_rank` orders nodes without knowing the others: a natural sort key of the
  topology address, so nodes under the same switch sort together and ``node2 < node10``.

Ray: :func:`ray_resources` and :func:`ray_labels` are what a node registers with
``ray start --resources/--labels`` (:func:`ray_start_args`), ``ray.init(resources=...,
labels=...)`` or ``Cluster.add_node(resources=..., labels=...)``.  Placement
(:mod:`erlay.supervisor.node.placement`) pins bundles with those resources.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from erlay.supervisor.errors import ErlayError

log = logging.getLogger("erlay.topology")

SMI = "nvidia-smi"
SMI_Q = "nvidia-smi -q"
TOPO_M = "nvidia-smi topo -m"
TOPOLOGY_ADDR_VAR = "SLURM_TOPOLOGY_ADDR"
DOMAIN_RESOURCE_PREFIX = "nvlink_domain_"
HOST_RESOURCE_PREFIX = "gpu_host_"
LABEL_PREFIX = "erlay.io/"
TOOL_TIMEOUT_S = 60.0

TopoRank = tuple[str | int, ...]
Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


class TopologyError(ErlayError):
    """A topology tool's output could not be read.  ``tool`` is the command, ``line`` the
    1-based line of its output (``None`` when the problem is not one line), ``expected`` what
    should have been there and ``got`` what was."""

    def __init__(self, tool: str, line: int | None, expected: str, got: str) -> None:
        self.tool = tool
        self.line = line
        self.expected = expected
        self.got = got
        where = f"line {line}: " if line is not None else ""
        super().__init__(f"{tool}: {where}expected {expected}, got {got!r}")


@dataclass(frozen=True)
class SmiGpu:
    """One GPU section of ``nvidia-smi -q``.  ``cluster_uuid``/``clique_id`` are ``None``
    when the GPU is in no multi-node NVLink partition."""

    index: int
    bus_id: str
    uuid: str
    cluster_uuid: str | None
    clique_id: int | None


@dataclass(frozen=True)
class GpuAffinity:
    """One GPU row of ``nvidia-smi topo -m``; empty tuples where the tool says ``N/A`` or the
    column is absent (drivers before 450 print no NUMA column)."""

    index: int
    cpus: tuple[int, ...]
    numa: tuple[int, ...]


@dataclass(frozen=True)
class GpuTopology:
    """One GPU: identity, NVLink partition and affinity."""

    index: int
    bus_id: str
    uuid: str
    cluster_uuid: str | None
    clique_id: int | None
    cpus: tuple[int, ...]
    numa: tuple[int, ...]


@dataclass(frozen=True)
class NodeTopology:
    """One machine.  ``nvlink_domain`` is the id of the NVLink domain all its GPUs share
    (``<ClusterUUID>.<CliqueId>`` on a multi-node NVLink fabric, ``node.<hostname>`` when the
    node is its own domain) and ``None`` without GPUs.  ``topo_addr`` is
    ``SLURM_TOPOLOGY_ADDR`` or the hostname; ``topo_rank`` its natural sort key."""

    hostname: str
    gpus: tuple[GpuTopology, ...]
    nvlink_domain: str | None
    topo_addr: str
    topo_rank: TopoRank


# ------------------------------------------------------------------------ small pure parts
def topo_rank(addr: str) -> TopoRank:
    """Natural sort key of a topology address or hostname: digit runs compare as numbers.

    ``"s1.s3.node12"`` -> ``("s", 1, ".s", 3, ".node", 12, "")``.  Strings sit at even and
    numbers at odd positions, so any two keys compare without a type error.  ``node01`` and
    ``node1`` tie; placement breaks ties by hostname."""
    parts = re.split(r"(\d+)", addr)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``"0-55,112-167"`` -> the sorted CPU (or NUMA node) ids; ``"N/A"`` -> ``()``.

    Raises ``ValueError`` on anything else; callers turn it into a :class:`TopologyError`
    with the line."""
    text = text.strip()
    if text == "N/A":
        return ()
    ids: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if m is None:
            raise ValueError(text)
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo:
            raise ValueError(text)
        ids.update(range(lo, hi + 1))
    return tuple(sorted(ids))


def format_cpulist(ids: Sequence[int]) -> str:
    """The inverse of :func:`parse_cpulist`: ``(0, 1, 2, 5)`` -> ``"0-2,5"``, ``()`` -> N/A."""
    if not ids:
        return "N/A"
    runs: list[str] = []
    ordered = sorted(set(ids))
    start = prev = ordered[0]
    for i in [*ordered[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(runs)


# ------------------------------------------------------------------------ nvidia-smi -q
_GPU_HEADER = re.compile(r"GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])")
# "Key   : value".  The key never holds a colon; values do (bus ids, clocks), so the split is
# the first colon that follows padding.  Values may be empty ("Chassis Serial Number : ").
_FIELD = re.compile(r"(\S[^:]*?)\s+:(?: (.*))?")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_ZERO_UUID = "00000000-0000-0000-0000-000000000000"
_NO_FABRIC_STATES = {"N/A", "Not Supported"}
_FABRIC_KEYS = ("State", "Status", "CliqueId", "ClusterUUID")


@dataclass
class _Section:
    line: int
    bus_id: str
    fields: dict[str, tuple[int, str]]          # top-level "Key : value" of the GPU section
    fabric: dict[str, tuple[int, str]] | None   # the Fabric section's fields, if it has one
    fabric_line: int = 0


def parse_smi_q(text: str) -> list[SmiGpu]:
    """Parse ``nvidia-smi -q`` into one :class:`SmiGpu` per GPU section, in output order.

    Checks that ``Attached GPUs`` matches the number of GPU sections and that each section has
    a ``GPU UUID`` and, where it has a ``Fabric`` section, all of State, Status, CliqueId and
    ClusterUUID.  Fabric rules (:func:`_fabric`): absent, ``N/A`` or ``Not Supported`` state,
    ``N/A`` ClusterUUID, or ``Completed`` with an all-zero ClusterUUID (H100 NVSwitch systems)
    mean no multi-node domain; ``Completed``/``Success`` with a real UUID is a domain; any
    other state (``Not Started``, ``In Progress``) or status is a :class:`TopologyError`.
    Top-level lines that are neither fields nor GPU headers (driver warnings) are ignored:
    the ``Attached GPUs`` count still catches a GPU header that was cut off."""
    attached: tuple[int, int] | None = None
    sections: list[_Section] = []
    in_fabric = False
    lines = text.splitlines()
    for n, raw in enumerate(lines, 1):
        line = raw.rstrip()
        body = line.strip()
        if not body:
            continue
        indent = len(line) - len(line.lstrip(" "))
        field = _FIELD.fullmatch(body)
        if indent == 0:
            header = _GPU_HEADER.fullmatch(body)
            if header:
                sections.append(_Section(n, header[1], {}, None))
            elif field and field[1] == "Attached GPUs":
                if not (field[2] or "").strip().isdigit():
                    raise TopologyError(SMI_Q, n, "a GPU count after 'Attached GPUs'", body)
                attached = (n, int(field[2]))
            continue
        if not sections:
            raise TopologyError(SMI_Q, n, "'GPU <bus id>' before indented lines", body)
        section = sections[-1]
        if indent == 4:
            # Only the 8-space fields right under the "Fabric" heading are fabric fields:
            # "State" and "CliqueId" also appear under other headings.
            in_fabric = body == "Fabric"
            if in_fabric:
                section.fabric, section.fabric_line = {}, n
            elif field:
                section.fields[field[1]] = (n, (field[2] or "").strip())
        elif indent == 8 and in_fabric and field and section.fabric is not None:
            section.fabric[field[1]] = (n, (field[2] or "").strip())
    if attached is None:
        raise TopologyError(SMI_Q, None, "an 'Attached GPUs : <n>' line", text[:80])
    if attached[1] != len(sections):
        raise TopologyError(SMI_Q, len(lines), f"{attached[1]} GPU sections "
                            f"('Attached GPUs' on line {attached[0]})",
                            f"{len(sections)} sections (truncated output?)")
    return [_smi_gpu(i, s) for i, s in enumerate(sections)]


def _smi_gpu(index: int, s: _Section) -> SmiGpu:
    if "GPU UUID" not in s.fields:
        raise TopologyError(SMI_Q, s.line, f"a 'GPU UUID' line in the section of GPU {s.bus_id}",
                            "none (truncated output?)")
    uuid_line, uuid = s.fields["GPU UUID"]
    if not uuid.startswith("GPU-"):
        raise TopologyError(SMI_Q, uuid_line, "'GPU-<uuid>'", uuid)
    cluster_uuid, clique_id = _fabric(s)
    return SmiGpu(index, s.bus_id, uuid, cluster_uuid, clique_id)


def _fabric(s: _Section) -> tuple[str | None, int | None]:
    """The (ClusterUUID, CliqueId) of one GPU section, or ``(None, None)`` when the GPU is in
    no multi-node NVLink domain.  The cases, in order, are the table in :func:`parse_smi_q`."""
    if s.fabric is None:
        return None, None
    missing = [k for k in _FABRIC_KEYS if k not in s.fabric]
    if missing:
        raise TopologyError(SMI_Q, s.fabric_line, f"{', '.join(_FABRIC_KEYS)} in the Fabric "
                            f"section of GPU {s.bus_id}", f"no {', '.join(missing)}")
    (state_line, state), (status_line, status) = s.fabric["State"], s.fabric["Status"]
    (uuid_line, cluster), (clique_line, clique) = s.fabric["ClusterUUID"], s.fabric["CliqueId"]
    if state in _NO_FABRIC_STATES or cluster == "N/A":
        return None, None
    if state != "Completed":
        raise TopologyError(SMI_Q, state_line, f"fabric State 'Completed' or 'N/A' for GPU "
                            f"{s.bus_id} (its NVLink domain is unknown until registration "
                            f"completes)", state)
    if not _UUID.fullmatch(cluster):
        raise TopologyError(SMI_Q, uuid_line, "a ClusterUUID like 8-4-4-4-12 hex digits", cluster)
    if cluster == _ZERO_UUID:  # H100 NVSwitch systems: registered, but in no fabric domain
        return None, None
    if status != "Success":
        raise TopologyError(SMI_Q, status_line, f"fabric Status 'Success' for GPU {s.bus_id} "
                            "(registration failed; check the fabric manager / IMEX)", status)
    if not clique.isdigit():
        raise TopologyError(SMI_Q, clique_line, "an integer CliqueId", clique)
    return cluster.lower(), int(clique)


# ------------------------------------------------------------------------ nvidia-smi topo -m
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_AFFINITY_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")


def parse_topo_m(text: str) -> list[GpuAffinity]:
    """Parse ``nvidia-smi topo -m`` (tab-separated, as the tool prints it) into one
    :class:`GpuAffinity` per ``GPU<n>`` row, ordered by index.

    The header must name every GPU column and ``CPU Affinity``; each GPU row must have its
    ``X`` on the diagonal (a shifted row is caught) and a value for each affinity column.
    Rows ``GPU0`` .. ``GPU<n-1>`` must all be there."""
    lines = [_ANSI.sub("", raw.rstrip("\n")) for raw in text.splitlines()]
    start = next((n for n, line in enumerate(lines, 1) if line.strip()), None)
    if start is None:
        raise TopologyError(TOPO_M, None, "a header line with GPU columns", "empty output")
    header = [c.strip() for c in lines[start - 1].split("\t")]
    if "CPU Affinity" not in header or header[0] != "":
        raise TopologyError(TOPO_M, start, "a tab-separated header ending in 'CPU Affinity'",
                            lines[start - 1])
    first_affinity = header.index("CPU Affinity")
    devices = header[1:first_affinity]
    affinity_columns = [c for c in header[first_affinity:] if c]
    gpu_columns = [d for d in devices if re.fullmatch(r"GPU\d+", d)]
    if gpu_columns != [f"GPU{i}" for i in range(len(gpu_columns))]:
        raise TopologyError(TOPO_M, start, "GPU0..GPU<n-1> columns", " ".join(gpu_columns))
    rows: dict[int, GpuAffinity] = {}
    for n in range(start + 1, len(lines) + 1):
        line = lines[n - 1]
        if not line.strip() or line.startswith("Legend"):
            break
        cells = line.split("\t")
        m = re.fullmatch(r"GPU(\d+)", cells[0].strip())
        if m is None:
            continue  # NIC rows
        rows[int(m[1])] = _topo_row(int(m[1]), cells, n, devices, affinity_columns)
    missing = [i for i in range(len(gpu_columns)) if i not in rows]
    if missing:
        raise TopologyError(TOPO_M, None, f"rows GPU0..GPU{len(gpu_columns) - 1}",
                            f"no row for GPU{missing[0]} (truncated output?)")
    return [rows[i] for i in range(len(gpu_columns))]


def _topo_row(index: int, cells: list[str], n: int, devices: list[str],
              affinity_columns: list[str]) -> GpuAffinity:
    matrix = [c.strip() for c in cells[1:1 + len(devices)]]
    own = f"GPU{index}"
    if own not in devices or len(matrix) < len(devices) or matrix[devices.index(own)] != "X":
        raise TopologyError(TOPO_M, n, f"{len(devices)} link cells with 'X' in column GPU{index}",
                            "\t".join(cells))
    # The tool pads "NUMA Affinity" with an empty cell before "GPU NUMA ID"; values are never
    # empty ("N/A" instead), so empty cells are padding.
    values = [c.strip() for c in cells[1 + len(devices):] if c.strip()]
    if len(values) != len(affinity_columns):
        raise TopologyError(TOPO_M, n, f"values for {', '.join(affinity_columns)}",
                            "\t".join(cells[1 + len(devices):]))
    by_column = dict(zip(affinity_columns, values, strict=True))
    try:
        cpus = parse_cpulist(by_column["CPU Affinity"])
        numa = parse_cpulist(by_column.get("NUMA Affinity", "N/A"))
    except ValueError as exc:
        raise TopologyError(TOPO_M, n, "CPU/NUMA lists like '0-55,112-167' or 'N/A'",
                            str(exc)) from None
    return GpuAffinity(index, cpus, numa)


# ------------------------------------------------------------------------ the whole node
def build_topology(hostname: str, smi: Sequence[SmiGpu], affinity: Sequence[GpuAffinity],
                   env: Mapping[str, str]) -> NodeTopology:
    """Combine both tools' views of one node; pure.  Raises :class:`TopologyError` when they
    disagree on the GPU count or the node's GPUs sit in different NVLink partitions (Ray's
    per-node resources cannot say which GPU belongs to which, so such a node cannot be placed
    correctly)."""
    if len(smi) != len(affinity):
        raise TopologyError(TOPO_M, None, f"{len(smi)} GPU rows, as {SMI_Q} lists",
                            f"{len(affinity)} rows")
    gpus = tuple(GpuTopology(s.index, s.bus_id, s.uuid, s.cluster_uuid, s.clique_id,
                             a.cpus, a.numa) for s, a in zip(smi, affinity, strict=True))
    domains = {_domain_of(g, hostname) for g in gpus}
    if len(domains) > 1:
        raise TopologyError(SMI_Q, None, "one NVLink partition (ClusterUUID, CliqueId) for "
                            f"all GPUs of {hostname}", ", ".join(sorted(domains)))
    addr = (env.get(TOPOLOGY_ADDR_VAR) or "").strip() or hostname
    if re.search(r"\s", addr) or not addr:
        raise TopologyError(TOPOLOGY_ADDR_VAR, None, "an address like 's1.s3.node12'", addr)
    return NodeTopology(hostname, gpus, domains.pop() if domains else None, addr,
                        topo_rank(addr))


def no_gpus(hostname: str, env: Mapping[str, str]) -> NodeTopology:
    """The topology of a machine without GPUs."""
    return build_topology(hostname, (), (), env)


def affinity_map(topology: NodeTopology) -> dict[int, dict[str, object]]:
    """The per-GPU affinity map :mod:`erlay.supervisor.node.numa` binds workers with:
    ``{index: {"cpus": "0-55,112-167", "numa": 0}}`` (``"N/A"``/``None`` where unknown).

    A GPU whose NUMA affinity lists several nodes (Grace: ``0,2-17``, the CPU's node then the
    GPU memory nodes the kernel numbers after all CPU nodes) maps to the lowest, the node
    that holds its CPUs."""
    return {g.index: {"cpus": format_cpulist(g.cpus), "numa": min(g.numa) if g.numa else None}
            for g in topology.gpus}


def _domain_of(gpu: GpuTopology, hostname: str) -> str:
    if gpu.cluster_uuid is None:
        return f"node.{hostname}"
    return f"{gpu.cluster_uuid}.{gpu.clique_id}"


def run_tool(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """The default runner: run ``argv`` with a timeout, capture text output, never raise on a
    nonzero exit (the caller reads ``returncode``)."""
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
                          check=False)


def discover(run: Runner = run_tool, env: Mapping[str, str] | None = None,
             hostname: str | None = None) -> NodeTopology:
    """Read this machine's topology with ``nvidia-smi -q`` and ``nvidia-smi topo -m``.

    ``run`` takes an argv and returns a ``CompletedProcess``; it raises ``FileNotFoundError``
    when the tool is missing, as ``subprocess.run`` does.  ``env`` defaults to ``os.environ``
    and ``hostname`` to ``socket.gethostname()``.  A missing ``nvidia-smi``, or one that finds
    no devices, gives the no-GPU topology; a failing or hanging one raises
    :class:`TopologyError`."""
    env = os.environ if env is None else env
    hostname = hostname or socket.gethostname()
    q = _call(run, [SMI, "-q"], SMI_Q)
    if q is None:
        log.info("%s: %s not found; a machine without GPUs", hostname, SMI)
        return no_gpus(hostname, env)
    if q.returncode == 6 and "No devices were found" in q.stdout + q.stderr:
        log.warning("%s: %s is installed but found no GPUs; treating %s as a machine without "
                    "GPUs", hostname, SMI, hostname)
        return no_gpus(hostname, env)
    smi = parse_smi_q(_stdout(q, SMI_Q))
    topo = _call(run, [SMI, "topo", "-m"], TOPO_M)
    if topo is None:
        raise TopologyError(TOPO_M, None, "the tool to run", f"{SMI} vanished")
    return build_topology(hostname, smi, parse_topo_m(_stdout(topo, TOPO_M)), env)


def _call(run: Runner, argv: list[str], tool: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return run(argv)
    except FileNotFoundError:
        return None
    except subprocess.TimeoutExpired:
        raise TopologyError(tool, None, f"an answer within {TOOL_TIMEOUT_S:.0f} s",
                            "no answer (hung driver?)") from None


def _stdout(done: subprocess.CompletedProcess[str], tool: str) -> str:
    if done.returncode != 0:
        detail = (done.stderr or done.stdout or "").strip().splitlines()
        raise TopologyError(tool, None, "exit status 0",
                            f"exit status {done.returncode}: {detail[-1] if detail else ''}")
    return done.stdout


# ------------------------------------------------------------------------ Ray registration
def domain_resource(domain: str) -> str:
    """The custom resource that counts a domain's GPUs on each of its nodes."""
    return f"{DOMAIN_RESOURCE_PREFIX}{domain}"


def host_resource(hostname: str) -> str:
    """The custom resource that counts one node's GPUs; placement pins bundles with it."""
    return f"{HOST_RESOURCE_PREFIX}{hostname}"


def ray_resources(topology: NodeTopology) -> dict[str, float]:
    """Custom resources for this node: ``nvlink_domain_<domain>`` and ``gpu_host_<hostname>``,
    each the node's GPU count.  Empty without GPUs.  Ray's own ``GPU`` resource is left to
    Ray's detection."""
    if not topology.gpus:
        return {}
    n = float(len(topology.gpus))
    domain = topology.nvlink_domain or f"node.{topology.hostname}"  # always set with GPUs
    return {domain_resource(domain): n, host_resource(topology.hostname): n}


_LABEL_VALUE = re.compile(r"([a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?)")


def ray_labels(topology: NodeTopology) -> dict[str, str]:
    """Node labels (Ray 2.60 ``--labels``): ``erlay.io/topo-addr``, ``erlay.io/host`` and,
    with GPUs, ``erlay.io/nvlink-domain``.  Ray takes Kubernetes-style values (63 characters,
    alphanumerics and ``-_.``); one that does not fit raises :class:`TopologyError`."""
    labels = {f"{LABEL_PREFIX}topo-addr": topology.topo_addr,
              f"{LABEL_PREFIX}host": topology.hostname}
    if topology.nvlink_domain is not None:
        labels[f"{LABEL_PREFIX}nvlink-domain"] = topology.nvlink_domain
    for key, value in labels.items():
        if not _LABEL_VALUE.fullmatch(value):
            raise TopologyError("ray labels", None, f"a label value for {key} of at most 63 "
                                "alphanumerics, '-', '_' or '.'", value)
    return labels


def ray_start_args(topology: NodeTopology) -> list[str]:
    """Arguments to add to ``ray start`` so the node registers its topology, e.g.
    ``["--resources", '{"nvlink_domain_...": 4.0, ...}', "--labels", "erlay.io/host=n1,..."]``.
    """
    labels = ",".join(f"{k}={v}" for k, v in ray_labels(topology).items())
    return ["--resources", json.dumps(ray_resources(topology), sort_keys=True),
            "--labels", labels]

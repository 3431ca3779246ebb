"""Bind a worker process to the CPUs and the memory node local to its GPU.

Input is an affinity map, ``{gpu_index: {"cpus": "0-55,112-167", "numa": 0}}``: for each
physical GPU index (as ``nvidia-smi topo -m`` numbers them), its CPU list in the kernel's
cpulist format and its NUMA node (``None`` where the topology has none).  Keys may be ints
or their strings (a map that went through JSON or YAML).

What is used, and how it degrades:

- **CPUs**: ``os.sched_setaffinity`` on every thread of the target process (the kernel
  applies it per thread; threads started later inherit it from their creator).  The CPUs of
  the map are intersected with the CPUs this process may use (``os.sched_getaffinity``):
  what is dropped is logged, and an empty intersection is a :class:`NumaBindError` naming
  both sets.
- **Memory**: the ``set_mempolicy(2)`` system call, made through libc's ``syscall()`` with
  ctypes, so neither libnuma nor ``numactl`` is needed.  ``preferred`` (the default) lets
  allocations spill to other nodes when the local one is full; ``bind`` forbids it.  The
  kernel sets a memory policy only for the calling thread, so memory is bound only when a
  process binds itself (``pid=0``) or when a child is bound at spawn.  Where the call is
  unavailable (an architecture missing from :data:`SET_MEMPOLICY`, a container whose seccomp
  profile refuses it, a node the kernel lacks) the CPUs are still bound and a warning says
  why memory is not.
- **No GPU** (``gpu`` is None, an empty map, or a GPU whose map entry has no CPU list, as
  ``nvidia-smi`` prints ``N/A`` in some VMs): a logged no-op; the :class:`Binding` says why.
  A GPU missing from a non-empty map is an error: a wrong map must not pass silently.

The CPUs "this process may use" are its current affinity, so binding only ever narrows: a
process already bound to one GPU's CPUs cannot be rebound to another GPU's.

Binding a child at spawn (:func:`bound_argv`) prefixes its command with a tiny wrapper,
``python -I -S -c <erlay.supervisor.node.numa.main> --cpus ... --numa ... -- <command>`` (isolated
and without site: it needs only the standard library and this package, found from this file's
location).  The wrapper binds itself, then replaces itself with the command (``execvp``).
Affinity and memory policy survive ``exec`` and are inherited through ``fork``, so the
command, all its threads and everything it spawns run bound from their first instruction,
under the pid the keeper registered.  This was chosen over ``os.sched_setaffinity(child_pid)``
right after spawn, which races the child (threads it starts before the call stay unbound)
and cannot set a memory policy, and over ``preexec_fn``, which is unsafe in a multi-threaded
parent such as a Ray worker.
"""

from __future__ import annotations

import argparse
import ctypes
import enum
import logging
import os
import platform
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from erlay.supervisor.errors import NumaBindError

log = logging.getLogger("erlay.supervisor.numa")

# One GPU's entry: {"cpus": "0-55,112-167", "numa": 0}.
AffinityMap = Mapping[Any, Mapping[str, object]]  # keys: int GPU indexes or their strings

# set_mempolicy's syscall number per machine (asm/unistd_64.h; asm-generic/unistd.h).
SET_MEMPOLICY: Mapping[str, int] = {"x86_64": 238, "aarch64": 237, "riscv64": 237}
_MAX_NODES = 1024
_NOT_A_LIST = {"", "n/a", "none"}
# Run with -I (no user site, no script directory), but with site: erlay is found where it is
# installed, wheel or editable.
_WRAPPER = "from erlay.supervisor.node.numa import main; main()"


class MemPolicy(enum.StrEnum):
    """The memory policy of a bound process."""

    PREFERRED = "preferred"   # MPOL_PREFERRED: the GPU's node first, others when it is full
    BIND = "bind"             # MPOL_BIND: the GPU's node only


_MPOL = {MemPolicy.PREFERRED: 1, MemPolicy.BIND: 2}


@dataclass(frozen=True)
class Binding:
    """What a process was (or, from :func:`plan_binding`, is to be) bound to.

    ``cpus`` is empty when nothing is bound, and then ``note`` says why.  ``dropped`` are
    CPUs of the map this process may not use.  ``memory`` is ``"preferred:N"``/``"bind:N"``
    when the policy was set (or is planned), ``"not set: <why>"`` when it could not be, and
    ``"none"`` when the map names no node.
    """

    gpu: int | None
    cpus: frozenset[int] = frozenset()
    numa: int | None = None
    dropped: frozenset[int] = frozenset()
    memory: str = "none"
    note: str = ""

    @property
    def bound(self) -> bool:
        return bool(self.cpus)


# -- pure ------------------------------------------------------------------------------
def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel cpulist (``"0-3,8"`` -> {0, 1, 2, 3, 8}); ``""`` is empty.

    Raises ValueError naming ``text`` when it is not a cpulist.
    """
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"not a CPU list: {text!r} (bad part {part!r})") from None
        if first < 0 or last < first:
            raise ValueError(f"not a CPU list: {text!r} (bad range {part!r})")
        cpus.update(range(first, last + 1))
    return cpus


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The compact cpulist of ``cpus`` ({0, 1, 2, 8} -> ``"0-2,8"``); ``""`` when empty."""
    parts: list[str] = []
    run: list[int] = []
    for cpu in sorted(set(cpus)):
        if run and cpu != run[-1] + 1:
            parts.append(_run_text(run))
            run = []
        run.append(cpu)
    if run:
        parts.append(_run_text(run))
    return ",".join(parts)


def _run_text(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def visible_gpu(environ: Mapping[str, str]) -> int | None:
    """The physical index of the first GPU in ``CUDA_VISIBLE_DEVICES``, or None when none is
    visible (unset, empty, ``-1``) or it is named by UUID, which the map cannot resolve.

    The index is taken to be ``nvidia-smi``'s; that holds when ``CUDA_DEVICE_ORDER`` is
    ``PCI_BUS_ID`` (which Ray and most launchers set).
    """
    first = environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    try:
        index = int(first)
    except ValueError:
        return None
    return index if index >= 0 else None


def _entry(gpu: int, affinity_map: AffinityMap) -> Mapping[str, object]:
    for key in (gpu, str(gpu)):
        if key in affinity_map:
            return affinity_map[key]
    known = ", ".join(sorted(str(k) for k in affinity_map))
    raise NumaBindError(f"GPU {gpu} is not in the affinity map (it knows GPUs {known})")


def plan_binding(gpu: int | None, affinity_map: AffinityMap, available: Iterable[int],
                 policy: MemPolicy = MemPolicy.PREFERRED) -> Binding:
    """What binding ``gpu`` means for a process that may use the CPUs ``available``.

    A no-op :class:`Binding` (with a note) when there is no GPU or no CPU list for it;
    raises :class:`NumaBindError` when ``gpu`` is missing from a non-empty map or none of
    its CPUs is available, and ValueError for a malformed map entry.
    """
    if gpu is None:
        return Binding(None, note="no GPU visible to this process")
    if not affinity_map:
        return Binding(gpu, note="empty affinity map (a machine without GPUs)")
    entry = _entry(gpu, affinity_map)
    cpu_text = entry.get("cpus")
    if cpu_text is None or str(cpu_text).strip().lower() in _NOT_A_LIST:
        return Binding(gpu, note=f"no CPU affinity known for GPU {gpu}")
    wanted = parse_cpu_list(str(cpu_text))
    allowed = set(available)
    cpus = wanted & allowed
    if not cpus:
        raise NumaBindError(f"GPU {gpu}: none of its CPUs {format_cpu_list(wanted)} is "
                            f"available to this process (allowed: {format_cpu_list(allowed)})")
    numa = _node(entry.get("numa"))
    return Binding(gpu, frozenset(cpus), numa, frozenset(wanted - allowed),
                   memory="none" if numa is None else f"{policy.value}:{numa}")


def _node(value: object) -> int | None:
    if value is None or str(value).strip().lower() in _NOT_A_LIST:
        return None
    node = int(str(value))
    if not 0 <= node < _MAX_NODES:
        raise ValueError(f"NUMA node out of range: {value!r}")
    return node


def wrapper_argv(argv: Sequence[str], binding: Binding,
                 policy: MemPolicy = MemPolicy.PREFERRED,
                 python: str = sys.executable) -> list[str]:
    """``argv`` run through the binding wrapper, or ``argv`` itself for a no-op binding."""
    if not binding.bound:
        return list(argv)
    wrapper = [python, "-I", "-c", _WRAPPER, "--cpus", format_cpu_list(binding.cpus)]
    if binding.numa is not None:
        wrapper += ["--numa", str(binding.numa), "--policy", policy.value]
    return [*wrapper, "--", *argv]


# -- the shell -------------------------------------------------------------------------
def bind_to_gpu(gpu: int | None, affinity_map: AffinityMap, pid: int = 0,
                policy: MemPolicy = MemPolicy.PREFERRED) -> Binding:
    """Bind process ``pid`` (0: this one) to the CPUs, and memory node, of ``gpu``.

    Every thread of the process gets the CPUs.  The memory policy is set only for
    ``pid=0``, and then for the calling thread and the threads it starts (a kernel limit:
    bind at spawn, :func:`bound_argv`, to cover a whole process).  Returns what was done;
    raises as :func:`plan_binding` does, and OSError if the CPUs cannot be set.
    """
    own = pid in (0, os.getpid())
    plan = plan_binding(gpu, affinity_map, os.sched_getaffinity(pid), policy)
    if not plan.bound:
        log.info("NUMA binding skipped: %s", plan.note)
        return plan
    _log_dropped(plan)
    _set_cpus(os.getpid() if own else pid, plan.cpus)
    memory = plan.memory
    if plan.numa is not None:
        memory = (_set_mempolicy(plan.numa, policy) if own else
                  "not set: the kernel sets a memory policy only for the calling process")
        if memory.startswith("not set"):
            log.warning("GPU %s: memory of pid %s %s", gpu, pid or os.getpid(), memory)
    binding = Binding(plan.gpu, plan.cpus, plan.numa, plan.dropped, memory)
    log.info("bound pid %s to GPU %s: CPUs %s, memory %s", pid or os.getpid(), gpu,
             format_cpu_list(binding.cpus), binding.memory)
    return binding


def bind_to_visible_gpu(affinity_map: AffinityMap, environ: Mapping[str, str] | None = None,
                        policy: MemPolicy = MemPolicy.PREFERRED) -> Binding:
    """:func:`bind_to_gpu` for this process's first ``CUDA_VISIBLE_DEVICES`` GPU (a no-op
    when none is visible)."""
    return bind_to_gpu(visible_gpu(os.environ if environ is None else environ), affinity_map,
                       policy=policy)


def bound_argv(argv: Sequence[str], gpu: int | None, affinity_map: AffinityMap,
               policy: MemPolicy = MemPolicy.PREFERRED) -> tuple[list[str], Binding]:
    """The command line that runs ``argv`` bound to ``gpu``, and the planned binding.

    Spawn the returned command as usual (e.g. ``ProcessKeeper.spawn``); the wrapper binds
    and then execs ``argv`` under the same pid.  The plan is made here, against this
    process's CPUs (which the child inherits), so errors surface in the parent; a failure
    to set the memory policy is only known in the child, which logs it to stderr.
    """
    plan = plan_binding(gpu, affinity_map, os.sched_getaffinity(0), policy)
    if not plan.bound:
        log.info("NUMA binding skipped for %s: %s", argv[0] if argv else "?", plan.note)
    else:
        _log_dropped(plan)
    return wrapper_argv(argv, plan, policy), plan


def _log_dropped(plan: Binding) -> None:
    if plan.dropped:
        log.warning("GPU %s: CPUs %s of the affinity map are not available here; using %s",
                    plan.gpu, format_cpu_list(plan.dropped), format_cpu_list(plan.cpus))


def _set_cpus(pid: int, cpus: frozenset[int]) -> None:
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile


def _set_mempolicy(node: int, policy: MemPolicy) -> str:
    """Set this thread's memory policy to ``node``; the Binding's ``memory`` text."""
    number = SET_MEMPOLICY.get(platform.machine())
    if number is None:
        return f"not set: no set_mempolicy syscall number known for {platform.machine()}"
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (_MAX_NODES // bits))()
    mask[node // bits] = 1 << (node % bits)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # maxnode counts one past the last bit, as libnuma passes it.
        if libc.syscall(number, _MPOL[policy], mask, ctypes.c_ulong(_MAX_NODES + 1)) != 0:
            return f"not set: set_mempolicy: {os.strerror(ctypes.get_errno())}"
    except (OSError, AttributeError) as exc:
        return f"not set: {exc}"
    return f"{policy.value}:{node}"


def main(args: Sequence[str] | None = None) -> None:
    """The spawn wrapper: bind this process, then exec the command after ``--``.

    Exits 126 when the CPUs cannot be set and 127 when the command cannot be executed.
    """
    logging.basicConfig(level=logging.WARNING, format="erlay.numa: %(message)s")
    parser = argparse.ArgumentParser(prog="erlay.supervisor.node.numa")
    parser.add_argument("--cpus", required=True)
    parser.add_argument("--numa", type=int)
    parser.add_argument("--policy", choices=[p.value for p in MemPolicy],
                        default=MemPolicy.PREFERRED.value)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    ns = parser.parse_args(args)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        parser.error("no command to run after --")
    try:
        os.sched_setaffinity(0, parse_cpu_list(ns.cpus))
    except (OSError, ValueError) as exc:
        log.error("cannot bind to CPUs %s: %s", ns.cpus, exc)
        sys.exit(126)
    if ns.numa is not None:
        memory = _set_mempolicy(ns.numa, MemPolicy(ns.policy))
        if memory.startswith("not set"):
            log.warning("node %d memory %s; CPUs are bound", ns.numa, memory)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        log.error("cannot run %s: %s", command[0], exc)
        sys.exit(127)


if __name__ == "__main__":
    main()


NUMA_ENV = "ERLAY_NUMA_BIND"


def bind_from_env(environ: Mapping[str, str] | None = None) -> None:
    """An actor init hook (``ERLAY_ACTOR_INIT``, see :mod:`erlay.supervisor.actor_child`):
    with ``ERLAY_NUMA_BIND=1`` and a visible GPU, bind this process (every thread, and what
    it spawns later) to the CPUs and memory local to that GPU, from this node's
    ``nvidia-smi topo -m``.  Without a GPU: nothing, not even the probe."""
    environ = os.environ if environ is None else environ
    if environ.get(NUMA_ENV) != "1" or visible_gpu(environ) is None:
        return
    from erlay.supervisor.node import topology
    bind_to_visible_gpu(topology.affinity_map(topology.discover()), environ)

"""Sandbox workers hosted in a node host on a real local Ray: bad programs sent through the
host come back as typed results, and neither the host nor the worker is restarted."""

from __future__ import annotations

from typing import Any

import psutil
import pytest

from erlay.sandbox.isolation import slot_uid
from erlay.sandbox.pool import sandbox_host_children
from erlay.sandbox.results import Outcome, SandboxRequest, SandboxResult
from erlay.supervisor.events import EventKind, MemorySink
from erlay.supervisor.host import host_spec
from erlay.supervisor.raylocal import local_node_id
from erlay.supervisor.spec import ChildSpec, SupervisorFlags, SupervisorStart
from erlay.supervisor.tree import SupervisionTree
from tests.sandbox.conftest import FORK_BOMB, KILL_PARENT, NAMESPACES, RUN_TOKEN_VAR

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local"),
              pytest.mark.skipif(not NAMESPACES, reason="needs root and a working unshare")]
FLAGS = SupervisorFlags("one_for_one", intensity=5, period=10)
LIMITS = {"wall_timeout_s": 2, "cpu_seconds": 10, "memory_mb": 256, "max_processes": 16}
FIRST_SLOT = 20  # uids 60020.. are this test's alone


def processes_with_run_tokens(tokens: set[str]) -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(RUN_TOKEN_VAR) in tokens:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def test_hosted_workers_survive_a_parent_kill_and_a_fork_bomb() -> None:
    import ray
    sink = MemorySink()
    host_child = host_spec("n0", FLAGS, sandbox_host_children(2, LIMITS, first_slot=FIRST_SLOT),
                           node_id=local_node_id())
    tree = SupervisionTree("sbx", FLAGS, [
        ChildSpec("sandbox", SupervisorStart(FLAGS, (host_child,)), type="supervisor"),
    ], sink=sink).start()
    try:
        host = tree.ref("sbx/sandbox/host@n0")

        def incarnations() -> dict[str, Any]:
            return {row["id"]: row["incarnation"]
                    for row in ray.get(host.which_children.remote(), timeout=10)}

        def execute(worker: str, key: str, code: str) -> SandboxResult:
            data = ray.get(host.call.remote(worker, "execute",
                                            (SandboxRequest(key, code).to_dict(),)), timeout=30)
            return SandboxResult.from_dict(data)

        host_pid = ray.get(host.ping.remote(), timeout=10)
        before = incarnations()
        assert before == {"sandbox-0": 1, "sandbox-1": 1}

        killer = execute("sandbox-0", "r-1/tool-0", KILL_PARENT)
        assert killer.outcome in (Outcome.OK, Outcome.KILLED)
        assert killer.isolation == f"unshare(net,pid)+uid{slot_uid(FIRST_SLOT)}"
        bomb = execute("sandbox-0", "r-1/tool-1", FORK_BOMB)
        assert bomb.outcome is Outcome.TIMEOUT and bomb.detail == "wall timeout 2 s"

        assert ray.get(host.ping.remote(), timeout=10) == host_pid
        assert incarnations() == before
        assert sink.of(EventKind.RESTART) == [] and sink.of(EventKind.HANG) == []
        stats = ray.get(host.call.remote("sandbox-0", "stats"), timeout=10)
        assert stats["runs"] == 2 and stats["outcomes"].get("timeout") == 1
        # A retry of the fork bomb under its key is answered from the cache, not re-run.
        assert execute("sandbox-0", "r-1/tool-1", FORK_BOMB) == bomb
        assert execute("sandbox-1", "r-2/tool-0", "print('still serving')").stdout == \
            "still serving\n"
        tokens = {killer.stdout.splitlines()[0], bomb.stdout.splitlines()[0]}
        assert processes_with_run_tokens(tokens) == []
    finally:
        tree.stop()

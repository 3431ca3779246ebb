"""The declared environment reaches a child's children: through the keeper, and through a
node host in a real tree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from erlay.supervisor.procs import ProcessKeeper
from tests.conftest import wait_for

DECLARED = {"LD_LIBRARY_PATH": "/opt/erlay-test/lib", "CUDA_HOME": "/opt/erlay-test/cuda",
            "NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "lo"}
# A child that spawns a second Python, which writes its environment to ERLAY_ENV_OUT.
SPAWNER = ("import os, subprocess, sys\n"
           "dump = 'import json, os; json.dump(dict(os.environ), open(os.environ[\"ERLAY_ENV_OUT\"]"
           ", \"w\"))'\n"
           "subprocess.run([sys.executable, '-S', '-c', dump], check=True)\n"
           "fd = os.environ.get('ERLAY_READY_FD')\n"
           "fd and os.write(int(fd), b'ready\\n')\n")


def grandchild_env(path: Path) -> dict[str, str]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def test_grandchild_of_a_keeper_child_sees_the_declared_env(tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    keeper = ProcessKeeper(env=DECLARED)
    try:
        child = keeper.spawn([sys.executable, "-S", "-c", SPAWNER],
                             env={"ERLAY_ENV_OUT": str(out)})
        assert child.wait(timeout=60) == 0
    finally:
        keeper.close()
    env = grandchild_env(out)
    assert {k: env.get(k) for k in DECLARED} == DECLARED
    assert env["ERLAY_HOST_TOKEN"] == keeper.token


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_grandchild_of_a_hosted_subprocess_sees_the_host_env(tmp_path: Path) -> None:
    from erlay.supervisor.host import host_spec
    from erlay.supervisor.raylocal import local_node_id
    from erlay.supervisor.spec import ChildSpec, SubprocessStart, SupervisorFlags, SupervisorStart
    from erlay.supervisor.tree import SupervisionTree

    out = tmp_path / "env.json"
    flags = SupervisorFlags("one_for_one", intensity=3, period=10)
    hosted = (ChildSpec("spawner", SubprocessStart(
        (sys.executable, "-S", "-c", SPAWNER + "import time; time.sleep(3600)\n"),
        env={"ERLAY_ENV_OUT": str(out)}, wait_ready=True, ready_timeout_s=60)),)
    host = host_spec("n0", flags, hosted, node_id=local_node_id(), env=DECLARED)
    tree = SupervisionTree("env", flags, [
        ChildSpec("pool", SupervisorStart(flags, (host,)), type="supervisor")]).start()
    try:
        wait_for(lambda: out.exists() and grandchild_env(out), 60,
                 what="the grandchild's environment")
    finally:
        tree.stop()
    env = grandchild_env(out)
    assert {k: env.get(k) for k in DECLARED} == DECLARED
    assert env["ERLAY_CHILD_PATH"] == "env/pool/host@n0/spawner"

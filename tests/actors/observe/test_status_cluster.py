"""``erlay status`` against a real local Ray with hand-made jobs: this test process is job
"alpha" (a driver with erlay's job metadata and a publisher), a child process is job "beta".
The cluster runs Ray's dashboard, so its URL can name it too.

One cluster serves the whole module; the last test stops it under a watching ``erlay status``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from erlay.actors.observe.status import (
    RUN_FILE,
    Cluster,
    StatusPublisher,
    cli_status,
    identity_metadata,
)
from tests.actors.observe.test_status import snapshot
from tests.conftest import wait_for
from tests.paths import REPO

pytestmark = pytest.mark.ray


def doc(run_id: str, name: str, step: int = 3) -> dict[str, Any]:
    return {"schema": 2, "interval_s": 0.2, "tree": snapshot(),
            "run": {"id": run_id, "name": name, "dir": f"/runs/{run_id}"},
            "job": {"phase": "rl", "step": step, "steps": 10, "reward": 0.5, "restarts": 0,
                    "uptime_s": 1.0, "driver": {"pid": os.getpid(), "host": "here"}}}


@dataclass
class Alpha:
    address: str
    dashboard: str    # http://127.0.0.1:PORT
    run_dir: Path
    job_id: str
    publisher: StatusPublisher


def env(**extra: str) -> dict[str, str]:
    """The environment of a child process: Ray 2.60's default token auth, as a user has it
    (``erlay status`` sends the token to a loopback cluster by itself)."""
    return {**{k: v for k, v in os.environ.items()
               if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}, **extra}


@pytest.fixture(scope="module")
def alpha(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Alpha]:
    import ray

    from erlay.supervisor.raylocal import ensure_ray, shutdown_ray
    patch = pytest.MonkeyPatch()
    patch.delenv("RAY_AUTH_MODE", raising=False)
    patch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():
        ray.shutdown()
    run_dir = tmp_path_factory.mktemp("runs") / "alpha-1"
    run_dir.mkdir()
    address = ensure_ray(num_cpus=1, include_dashboard=True, dashboard_port=0,
                         metadata=identity_metadata("alpha", "alpha-1", run_dir,
                                                    "alpha.yaml"))["address"]
    dashboard = f"http://{ray._private.worker.get_dashboard_url()}"
    publisher = StatusPublisher(lambda: doc("alpha-1", "alpha"), 0.2, run_dir)
    publisher.start()
    wait_for(lambda: publisher.published >= 1, what="alpha's first snapshot")
    try:
        yield Alpha(address, dashboard, run_dir, ray.get_runtime_context().get_job_id(),
                    publisher)
    finally:
        publisher.stop()
        if ray.is_initialized():
            shutdown_ray()
        patch.undo()


def args(address: str | None, **kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"address": address, "run_dir": None, "job": None,
                                 "watch": False, "interval": 0.2, "json": False, **kw})


def erlay_status(*argv: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "erlay.supervisor.cli", "status", *argv],
                            cwd=REPO, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def drivers(address: str) -> int:
    """Ray jobs the GCS has ever registered (a reader that joined would add one)."""
    return len(Cluster(address).client.get_all_job_info(timeout=5))


BETA = """
import sys, json, time
from pathlib import Path
from erlay.supervisor.raylocal import ensure_ray
from erlay.actors.observe.status import StatusPublisher, identity_metadata
address, run_dir, doc = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
ensure_ray(address, metadata=identity_metadata("beta", "beta-1", run_dir, "beta.yaml"))
pub = StatusPublisher(lambda: dict(doc), 0.2, run_dir)
pub.start()
while pub.published < 1:
    time.sleep(0.05)
print("published", flush=True)
sys.stdin.read()  # until the test closes it
pub.finish("finished", "all 10 steps trained", 0)
pub.stop()
"""


def test_the_one_job_is_shown_by_address_or_run_dir_without_joining_the_cluster(
        alpha: Alpha, capsys: pytest.CaptureFixture[str]) -> None:
    before = drivers(alpha.address)
    proc = erlay_status("--address", alpha.address)  # a real CLI process, as a user runs it
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "run alpha-1  name alpha" in out and "erlay [one_for_one]" in out
    assert drivers(alpha.address) == before  # status registered no Ray job

    record = json.loads((alpha.run_dir / RUN_FILE).read_text())
    assert record["job_id"] == alpha.job_id
    assert cli_status(args(None, run_dir=str(alpha.run_dir), json=True)) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["ray_job_id"] == alpha.job_id and view["run"]["name"] == "alpha"
    assert view["running"] and view["outcome"] is None
    assert {c["path"] for c in view["children"]} >= {"erlay/generation/engine-0"}

    (job,) = Cluster(alpha.address).jobs()  # the identity, from Ray's job metadata
    assert (job.name, job.run_id, job.run_dir, job.config) == (
        "alpha", "alpha-1", str(alpha.run_dir), "alpha.yaml")


def test_a_dashboard_url_shows_the_same_tree_as_the_gcs_address(alpha: Alpha) -> None:
    """``--address http://HEAD:8265``, as ``ray job submit`` users name a cluster: the
    dashboard's node summary names the GCS, and the tree is read from there."""
    before = drivers(alpha.address)
    by_gcs = erlay_status("--address", alpha.address)
    by_dashboard = erlay_status("--address", alpha.dashboard)
    gcs_out, gcs_err = by_gcs.communicate(timeout=60)
    out, err = by_dashboard.communicate(timeout=60)
    assert (by_gcs.returncode, by_dashboard.returncode) == (0, 0), gcs_err + err
    header, tree = out.split("\n\n", 1)
    assert tree == gcs_out.split("\n\n", 1)[1] and "└─ engine-1" in tree
    assert f"ray {alpha.address} (dashboard {alpha.dashboard})  job {alpha.job_id}" in header
    assert drivers(alpha.address) == before  # neither registered a Ray job


def test_several_jobs_are_listed_and_watch_ends_with_the_job(
        alpha: Alpha, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    beta = subprocess.Popen([sys.executable, "-c", BETA, alpha.address, str(tmp_path),
                             json.dumps(doc("beta-1", "beta"))], cwd=REPO,
                            env=env(RAY_AUTH_MODE="token"),  # a driver at an explicit address
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    watch = None
    try:
        assert beta.stdout is not None and beta.stdout.readline().strip() == "published"
        assert cli_status(args(alpha.address)) == 2  # never picks one
        listing = capsys.readouterr().err
        assert "--job NAME_OR_ID" in listing
        assert "alpha-1" in listing and "beta-1" in listing and str(tmp_path) in listing
        assert cli_status(args(alpha.address, json=True)) == 2
        jobs = json.loads(capsys.readouterr().out)["jobs"]
        assert sorted(j["name"] for j in jobs) == ["alpha", "beta"]

        assert cli_status(args(alpha.address, job="beta")) == 0
        assert "run beta-1  name beta" in capsys.readouterr().out

        watch = erlay_status("--address", alpha.address, "--job", "beta-1", "--watch",
                             "--interval", "0.2")
        time.sleep(1.0)  # let it show the running job first
        assert watch.poll() is None
        beta.stdin.close()  # type: ignore[union-attr]
        out, err = watch.communicate(timeout=30)
        assert watch.returncode == 0, err
        assert "ENDED FINISHED (exit code 0): all 10 steps trained" in out
        assert err.strip().splitlines()[-1] == "erlay: job beta-1 ended: finished (exit code 0)"
    finally:
        for proc in (beta, watch):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    # beta ended: alpha is the one again, once Ray's job table has seen beta's driver go
    # (it notices the driver's exit a moment after the run dir says ended).
    deadline = time.monotonic() + 15.0
    while cli_status(args(alpha.address)) == 2 and time.monotonic() < deadline:
        capsys.readouterr()
        time.sleep(0.5)
    assert cli_status(args(alpha.address)) == 0
    assert "run alpha-1" in capsys.readouterr().out


class Probe:
    def ping(self) -> str:
        return "pong"


def test_a_supervised_actor_shows_its_tree_path_state_and_incarnation_as_repr(
        alpha: Alpha) -> None:
    import ray
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    from erlay.supervisor.actor_child import supervised_class
    handle = supervised_class(Probe).options(name="erlay/test/probe-0", num_cpus=0).remote(
        _erlay_incarnation=3)
    try:
        assert ray.get(handle.ping.remote(), timeout=60) == "pong"
        accessor = state._connect_and_get_accessor()

        def repr_name() -> str:
            info = accessor.get_actor_info(handle._actor_id)
            return gcs_pb2.ActorTableData.FromString(info).repr_name if info else ""

        assert wait_for(repr_name, what="the Repr") == "erlay/test/probe-0 running inc=3"
    finally:
        ray.kill(handle)


def test_watch_exits_at_once_when_the_cluster_goes_away(alpha: Alpha) -> None:
    """Last in the module: it stops the module's cluster."""
    from erlay.supervisor.raylocal import shutdown_ray
    watch = erlay_status("--address", alpha.address, "--watch", "--interval", "0.2")
    try:
        assert watch.stdout is not None
        assert watch.stdout.readline().startswith("run alpha-1")
        # The GCS dies under a running job (a head node lost): the job is never marked
        # ended, so the watcher must notice the cluster itself is gone.
        (gcs,) = [p for p in psutil.Process().children(recursive=True)
                  if "gcs_server" in " ".join(p.cmdline())]
        gcs.kill()
        gone = time.monotonic()
        _, err = watch.communicate(timeout=30)
        took = time.monotonic() - gone
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
        alpha.publisher.stop()
        shutdown_ray()
    assert watch.returncode == 1, err
    assert f"erlay: the Ray cluster at {alpha.address} went away" in err
    assert took < 5.0, took

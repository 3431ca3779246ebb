"""The same job through `ray job submit`, on a loopback `ray start --head` cluster."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.paths import REPO

ROOT = REPO
pytestmark = [pytest.mark.slow, pytest.mark.ray]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_ray_job_submit_runs_the_job_to_success(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import ray
    if ray.is_initialized():
        ray.shutdown()
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    # Every port on a free one: Ray's fixed defaults (the dashboard agent's 52365 above
    # all) may still be held by an agent of another Ray on this machine.
    gcs, dashboard, agent = free_port(), free_port(), free_port()
    head = subprocess.Popen(
        [str(bin_dir / "ray"), "start", "--head", "--block", f"--port={gcs}",
         "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={agent}",
         "--num-cpus=4", "--include-dashboard=true"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    # The job SDK talks plain HTTP to the dashboard.  Set for this test only: later tests
    # in this process start their own Ray, and Ray caches its auth settings per process.
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    from ray.job_submission import JobStatus, JobSubmissionClient
    try:
        client = None
        for _ in range(60):  # the dashboard takes a few seconds to come up
            try:
                client = JobSubmissionClient(address)
                break
            except Exception:  # not up yet: connection refused, 5xx
                time.sleep(2)
        assert client is not None, f"no job server at {address}"
        # The cluster's python must have erlay's dependencies; here it is this venv's.
        job_id = None
        for _ in range(30):  # the job agent comes up a little after the dashboard
            try:
                job_id = client.submit_job(
                    entrypoint=f"{sys.executable} -m erlay.supervisor.cli run configs/cpu.yaml "
                               f"run.steps=3 warm_start.steps=2 --no-progress "
                               f"run.run_dir={tmp_path}",
                    runtime_env={"working_dir": str(ROOT)})
                break
            except RuntimeError as exc:  # "No available agent to submit job" (HTTP 500)
                if "agent" not in str(exc):
                    raise
                time.sleep(2)
        assert job_id is not None, "the job agent never came up"
        deadline = time.monotonic() + 240
        status = client.get_job_status(job_id)
        while time.monotonic() < deadline and not status.is_terminal():
            time.sleep(2)
            status = client.get_job_status(job_id)
        logs = client.get_job_logs(job_id)
        message = client.get_job_info(job_id).message
        assert status == JobStatus.SUCCEEDED, f"{status}: {message}\n{logs[-3000:]}"
        assert "status: **finished**" in logs
        assert list(tmp_path.glob("arithmetic-*/summary.md"))
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)

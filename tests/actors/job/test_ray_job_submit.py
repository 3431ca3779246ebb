"""The README's and docs/cluster.md's ``ray job submit`` command, run as written against a
loopback ``ray start --head`` with Ray's default token authentication on."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.paths import REPO

CLUSTER_DOC = REPO / "docs" / "cluster.md"
README = REPO / "README.md"
# A two-step job: the command as documented, with these overrides appended.
TINY = ["run.steps=2", "warm_start.steps=2", "warm_start.examples=16", "warm_start.batch_size=4",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_staleness=0"]
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kill_session(sid: int) -> None:
    """SIGKILL what is left of session ``sid``: Ray's workers take process groups of their
    own, which a kill of the head's group does not reach."""
    import psutil
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                proc.kill()
        except (OSError, psutil.Error):
            continue


def submit_block(page: Path, heading: str) -> str:
    """The first fenced bash block after ``heading`` in ``page`` that runs ``ray job
    submit``, as written."""
    text = page.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        if "ray job submit" in block:
            return block
    raise AssertionError(f"{page.name}: no `ray job submit` block after {heading!r}")


def runnable(block: str, dashboard: int) -> str:
    """``block`` against the loopback head, its ``erlay run`` made a two-step job."""
    assert "http://HEAD:8265" in block and block.rstrip().endswith(
        "erlay run configs/cpu.yaml --no-progress"), block
    return block.replace("HEAD:8265", f"127.0.0.1:{dashboard}").rstrip() + " " + " ".join(TINY)


def test_the_readme_shows_the_same_command_as_the_cluster_doc() -> None:
    assert submit_block(README, "## Running on a cluster") == \
        submit_block(CLUSTER_DOC, "## Submitting")


def unauthenticated_status(url: str, timeout_s: float) -> int:
    """The HTTP status of a GET without a token, once the dashboard answers at all."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:  # not up yet: connection refused
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.ray
def test_the_documented_ray_job_submit_runs_with_token_auth(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = Path(sys.executable).parent
    # A fresh user: Ray's defaults, erlay's `erlay` and `ray` on PATH, no storage set.  The
    # token lives in this HOME, so the user's own ~/.ray is never touched.
    env = {**os.environ, "HOME": str(home), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    for var in ("RAY_ADDRESS", "ERLAY_STORAGE", *AUTH_VARS):
        env.pop(var, None)
    # What any local ray.init() (a local `erlay run` included) leaves: ~/.ray/auth_token.
    subprocess.run(["ray", "get-auth-token", "--generate"], env=env, check=True,
                   capture_output=True, timeout=60)
    assert (home / ".ray" / "auth_token").is_file()
    # Every port on a free one: Ray's fixed defaults (the dashboard agent's 52365 above
    # all) may still be held by an agent of another Ray on this machine.
    gcs, dashboard, agent = free_port(), free_port(), free_port()
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={gcs}",
         "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={agent}",
         "--num-cpus=4", "--include-dashboard=true"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Token authentication is on (Ray's default with a token present): no token, 401.
        status = unauthenticated_status(f"http://127.0.0.1:{dashboard}/api/jobs/", 90)
        assert status == 401, f"the jobs API answered {status} without a token"
        command = runnable(submit_block(CLUSTER_DOC, "## Submitting"), dashboard)
        without_export = command.replace("export RAY_AUTH_MODE=token", "")
        assert without_export != command
        # The failure the docs prevent: the client sends no token without RAY_AUTH_MODE.
        bare = subprocess.run(["bash", "-c", without_export], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)
        assert bare.returncode != 0 and "Authentication" in bare.stdout + bare.stderr, \
            bare.stdout[-2000:] + bare.stderr[-2000:]
        result = None
        for _ in range(15):  # the job agent comes up a little after the dashboard
            result = subprocess.run(["bash", "-e", "-c", command], cwd=REPO, env=env,
                                    capture_output=True, text=True, timeout=240)
            if "No available agent" not in result.stdout + result.stderr:
                break
            time.sleep(2)
        assert result is not None
        out = result.stdout + result.stderr
        assert result.returncode == 0 and "succeeded" in out, out[-4000:]
        # The job's own log starts after Ray's "Running entrypoint" line; its first line is
        # the run directory.
        log = result.stdout.split("Running entrypoint for job", 1)[1].splitlines()[1:]
        first = next(line for line in log if line.strip())
        assert first.startswith("erlay: run directory /"), "\n".join(log[:12])
        run_dir = Path(first.removeprefix("erlay: run directory ").strip())
        # Under the stable default, not in Ray's temporary copy of the working directory.
        assert run_dir.parent == home / "erlay-runs", run_dir
        assert "working_dir_files" not in run_dir.parts
        assert "status: **finished**" in (run_dir / "summary.md").read_text(encoding="utf-8")
    finally:
        # Ray's own shutdown of a `--block` head takes ~30 s here; the job is over, so the
        # whole process group (the head and everything it started) goes at once.
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)
        kill_session(head.pid)

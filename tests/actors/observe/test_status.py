"""``erlay status``: rendering from hand-made snapshots, choosing a job, and the real CLI
watching a real job whose engine is SIGKILLed (the cluster-level contracts, with several jobs,
are in test_status_cluster.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, cast

import pytest

from erlay.actors.observe.status import Cluster, JobEntry, choose_job, cli_status
from erlay.actors.observe.status_view import (
    flatten,
    format_age,
    render_json,
    render_text,
    status_view,
)
from tests.conftest import wait_for
from tests.paths import REPO

ROOT = REPO
ENGINE = "erlay/generation/engine-0"


def row(cid: str, path: str, **kw: Any) -> dict[str, Any]:
    base = {"id": cid, "path": path, "status": "running", "type": "worker", "incarnation": 1,
            "restarts": 0, "last_exit": None, "info": {}, "phase": None, "work": None,
            "progress_age_s": None}
    return {**base, **kw}


def snapshot() -> dict[str, Any]:
    engines = [
        row("engine-0", ENGINE, incarnation=2, restarts=1, info={"pid": 4242},
            last_exit="error: actor process died (SYSTEM_ERROR)", phase="decode_step",
            work="r3-1", progress_age_s=0.25),
        row("engine-1", "erlay/generation/engine-1", info={"pid": 4343}, progress_age_s=75.0),
    ]
    learners = [row("learner-0", "erlay/learner/learner-0", incarnation=2, restarts=1,
                    last_exit="shutdown", info={"pid": 4141}, progress_age_s=1.0)]
    hosted = [row("sandbox-1", "erlay/sandbox/host@node-0/sandbox-1", info={"pid": 4545},
                  phase="tool_call", work="r2-0", progress_age_s=0.5)]
    return {"path": "erlay", "strategy": "one_for_one", "intensity": 3, "period": 60,
            "status": "running", "children": [
                row("learner", "erlay/learner", type="supervisor", strategy="one_for_all",
                    info={"kind": "supervisor"}, children=learners),
                row("generation", "erlay/generation", type="supervisor",
                    strategy="one_for_one", children=engines),
                row("sandbox", "erlay/sandbox", type="supervisor", strategy="one_for_one",
                    children=[row("host@node-0", "erlay/sandbox/host@node-0",
                                  type="supervisor", info={"pid": 4444},
                                  progress_age_s=30.0, children=hosted)]),
                row("rollout", "erlay/rollout", type="supervisor", strategy="rest_for_one",
                    children=[row("coordinator", "erlay/rollout/coordinator", watched=False,
                                  info={"pid": 99}, progress_age_s=40.0)]),
            ]}


def doc(**job: Any) -> dict[str, Any]:
    summary = {"phase": "rl", "step": 11, "steps": 100, "reward": 0.4129, "restarts": 2,
               "uptime_s": 40.0, "driver": {"pid": 99, "host": "box"}, **job}
    return {"schema": 1, "interval_s": 1.0, "job": summary, "tree": snapshot(),
            "run": {"id": "arithmetic-20250101-120000", "name": "arithmetic",
                    "dir": "runs/arithmetic-20250101-120000"}}


def view(age_s: float = 0.4, **job: Any) -> dict[str, Any]:
    return status_view({"doc": doc(**job), "age_s": age_s}, address="127.0.0.1:6379",
                       job_id="01000000")


def line_of(text: str, cid: str) -> str:
    return next(line for line in text.splitlines() if f"─ {cid}" in line)


def cells(text: str, cid: str) -> list[str]:
    """The row of ``cid`` after the tree column, one string per column."""
    start = next(line for line in text.splitlines() if line.startswith("CHILD")).index("STATE")
    return re.split(r"\s{2,}", line_of(text, cid)[start:].strip())


# ------------------------------------------------------------------------ rendering

def test_text_shows_each_child_with_state_incarnation_restarts_work_and_failure() -> None:
    text = render_text(view())
    assert cells(text, "engine-0") == ["running", "2", "1", "4242", "0.2s", "decode_step r3-1",
                                       "error: actor process died (SYSTEM_ERROR)"]
    assert cells(text, "engine-1") == ["running", "1", "0", "4343", "1m15s", "idle", "-"]


def test_text_draws_the_tree_with_supervisors_and_hosted_children() -> None:
    lines = render_text(view()).splitlines()
    table = lines[lines.index("") + 1:]
    assert table[0].split()[:3] == ["CHILD", "STATE", "INC"]
    assert table[1].startswith("erlay [one_for_one]")
    width = table[0].index("STATE")
    names = [line[:width].rstrip() for line in table[2:]]
    assert names == ["├─ learner [one_for_all]", "│  └─ learner-0",
                     "├─ generation [one_for_one]", "│  ├─ engine-0", "│  └─ engine-1",
                     "├─ sandbox [one_for_one]", "│  └─ host@node-0", "│     └─ sandbox-1",
                     "└─ rollout [rest_for_one]", "   └─ coordinator"]


def test_progress_is_shown_only_for_children_the_supervisor_watches() -> None:
    text = render_text(view())
    assert cells(text, "sandbox-1")[4:6] == ["0.5s", "tool_call r2-0"]
    assert cells(text, "host@node-0")[3:6] == ["4444", "-", "-"]  # a supervisor: no progress
    assert cells(text, "coordinator")[3:6] == ["99", "-", "-"]  # no deadlines: never polled


def test_a_restart_caused_by_a_sibling_is_not_shown_as_a_failure() -> None:
    text = render_text(view())
    assert cells(text, "learner-0")[1:3] == ["2", "1"] and cells(text, "learner-0")[-1] == "-"


def test_header_shows_run_step_reward_restarts_uptime_and_snapshot_age() -> None:
    header = render_text(view(age_s=0.4)).splitlines()[:3]
    assert header[0] == ("run arithmetic-20250101-120000  name arithmetic  "
                         "(runs/arithmetic-20250101-120000)")
    assert header[1].split("   ") == ["step 12/100", "last reward 0.413", "restarts 2",
                                      "uptime 40s", "snapshot 0.4s old"]
    assert "driver pid 99 on box" in header[2] and "127.0.0.1:6379  job 01000000" in header[2]


def test_header_names_the_warm_start_before_the_first_rl_step() -> None:
    header = render_text(view(phase="warm_start", step=None, reward=None)).splitlines()[1]
    assert header.startswith("step 0/100 (warm start)   last reward -")


def test_a_snapshot_older_than_a_few_intervals_is_marked_stale() -> None:
    assert not view(age_s=2.0)["stale"]
    stale = view(age_s=12.0)
    assert stale["stale"] and "STALE" in render_text(stale).splitlines()[1]


def test_lines_are_cut_to_the_terminal_width() -> None:
    lines = render_text(view(), width=50).splitlines()
    assert max(len(line) for line in lines) == 50
    assert line_of("\n".join(lines), "engine-0").endswith("…")


def test_json_lists_every_child_by_path_and_advances_uptime_by_the_age() -> None:
    out = json.loads(render_json(view(age_s=3.0)))
    by_path = {c["path"]: c for c in out["children"]}
    assert set(by_path) == {"erlay/learner", "erlay/learner/learner-0", "erlay/generation",
                            ENGINE, "erlay/generation/engine-1", "erlay/sandbox",
                            "erlay/sandbox/host@node-0", "erlay/sandbox/host@node-0/sandbox-1",
                            "erlay/rollout", "erlay/rollout/coordinator"}
    assert by_path[ENGINE]["restarts"] == 1 and by_path[ENGINE]["incarnation"] == 2
    assert "children" not in by_path["erlay/generation"]
    assert out["tree"]["children"][1]["children"][0]["id"] == "engine-0"
    assert out["job"]["uptime_s"] == 43.0 and out["snapshot_age_s"] == 3.0
    assert out["run"]["id"] == "arithmetic-20250101-120000" and out["stale"] is False


def test_ages_read_as_seconds_minutes_and_hours() -> None:
    assert [format_age(s) for s in (None, 0.04, 12.4, 185, 7620)] == \
        ["-", "0.0s", "12s", "3m05s", "2h07m"]


# ------------------------------------------------------------------ choosing a job

def job(run_id: str, job_id: str, alive: bool = True, name: str = "") -> JobEntry:
    return JobEntry(job_id=job_id, run_id=run_id, name=name or run_id.split("-")[0],
                    run_dir=f"/runs/{run_id}", alive=alive)


def test_no_running_job_is_exit_1() -> None:
    for jobs in ([], [job("a-1", "01000000", alive=False)]):
        choice = choose_job(jobs, None, "auto")
        assert (choice.job, choice.exit_code) == (None, 1)
        assert choice.message == "erlay: no running erlay job found at auto"


def test_the_only_running_job_is_chosen_without_asking() -> None:
    jobs = [job("a-1", "01000000", alive=False), job("b-2", "02000000")]
    assert choose_job(jobs, None, "x").job == jobs[1]


def test_several_running_jobs_are_listed_with_the_flag_and_none_is_picked() -> None:
    jobs = [job("a-1", "01000000"), job("b-2", "02000000"), job("c-3", "03000000", False)]
    choice = choose_job(jobs, None, "x")
    assert choice.job is None and choice.exit_code == 2
    assert "--job NAME_OR_ID" in choice.message
    rows = [line.split() for line in choice.message.splitlines()[1:]]
    assert rows == [["NAME", "ID", "RAY", "JOB", "STATE", "RUN", "DIR"],
                    ["a", "a-1", "01000000", "running", "/runs/a-1"],
                    ["b", "b-2", "02000000", "running", "/runs/b-2"]]


def test_job_picks_by_run_id_name_or_ray_job_id_then_by_unique_prefix() -> None:
    jobs = [job("arith-1", "01000000"), job("arith-10", "02000000"),
            job("tools-1", "03000000", name="toolrun")]
    assert choose_job(jobs, "arith-1", "x").job == jobs[0]  # exact beats prefix
    assert choose_job(jobs, "toolrun", "x").job == jobs[2]
    assert choose_job(jobs, "02000000", "x").job == jobs[1]
    assert choose_job(jobs, "tools", "x").job == jobs[2]
    several = choose_job(jobs, "arith", "x")  # both named "arith": listed, not picked
    assert several.exit_code == 2 and several.job is None and "arith-10" in several.message
    missing = choose_job(jobs, "nope", "x")
    assert missing.exit_code == 1 and "no erlay job 'nope'" in missing.message
    assert "tools-1" in missing.message


def test_a_named_job_that_ended_is_still_found_but_a_running_twin_wins() -> None:
    old, new = job("a-1", "01000000", alive=False), job("a-2", "02000000")
    assert choose_job([old], "a-1", "x").job == old  # shows how it ended
    assert choose_job([old, new], "a", "x").job == new


def test_a_dead_driver_without_an_outcome_is_shown_as_ended() -> None:
    gone = status_view({"doc": doc(), "age_s": 30.0}, address="x", job_id="01", alive=False)
    assert not gone["running"] and not gone["stale"]
    assert render_text(gone).startswith("ENDED ENDED (exit code ?): the driver exited")


def status_args(address: str, **kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"address": address, "run_dir": None, "job": None,
                                 "watch": False, "interval": 1.0, "json": False, **kw})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_no_cluster_at_the_address_exits_1_with_the_message(
        capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    assert cli_status(status_args(address)) == 1
    assert f"erlay: no running erlay job found at {address}" in capsys.readouterr().err


def test_a_run_dir_names_its_cluster_or_says_why_it_cannot(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_status(status_args(None, run_dir=str(tmp_path))) == 1
    assert "status.json does not exist" in capsys.readouterr().err
    address = f"127.0.0.1:{free_port()}"  # the run's cluster is gone
    (tmp_path / "status.json").write_text(json.dumps({"address": address, "job_id": "01"}))
    assert cli_status(status_args(None, run_dir=str(tmp_path))) == 1
    assert f"no running erlay job found at {address}" in capsys.readouterr().err


# ------------------------------------------------------- a real job, the real CLI

def erlay_status(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "erlay.supervisor.cli", "status", *args],
                          cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def live_row(cluster: Cluster, job_id: str) -> dict[str, Any] | None:
    """The engine's row as published (read in-process from the GCS), once the tree has
    booted."""
    read = cluster.read(job_id)
    if read is None or read["doc"]["tree"]["status"] != "running":
        return None
    return {c["path"]: c for c in flatten(read["doc"]["tree"])}[ENGINE]


def cli_row(address: str) -> dict[str, Any]:
    """The engine's row as ``erlay status --json`` prints it."""
    out = erlay_status("--json", "--address", address)
    assert out.returncode == 0, out.stderr[-2000:]
    return {c["path"]: c for c in json.loads(out.stdout)["children"]}[ENGINE]


def engine_repr(name: str = ENGINE) -> str:
    """The Repr column the dashboard shows for the actor named ``name`` (from the GCS)."""
    import ray
    from ray._private.state import state
    from ray.core.generated import gcs_pb2
    handle = ray.get_actor(name)
    info = state._connect_and_get_accessor().get_actor_info(handle._actor_id)
    return str(gcs_pb2.ActorTableData.FromString(info).repr_name)


@pytest.mark.ray
def test_cli_shows_a_sigkilled_engine_restarted_in_the_live_tree(tmp_path: Path,
                                                                 fresh_ray: None) -> None:
    import ray

    from erlay.actors.config import load_config
    from erlay.actors.job.driver import Job, JobResult
    from erlay.actors.rundir import RunDir
    cfg = load_config(ROOT / "configs" / "cpu-builtin.yaml", [   # starts faster than the HF one
        "run.steps=100000", "warm_start.steps=2", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "engine.num_engines=2", "ray.num_cpus=4",
        "checkpoint.every_steps=100000", f"run.storage={tmp_path}"])
    job = Job(cfg, RunDir.create(tmp_path, "status"))
    results: list[JobResult] = []
    runner = threading.Thread(target=lambda: results.append(job.run(progress=False)))
    runner.start()
    try:
        # Generous deadlines: the job boots a Ray and a dozen processes on two shared cores.
        wait_for(lambda: job.tree is not None and job.tree.alive, timeout=120,
                 what="the job's tree")
        address = ray.get_runtime_context().gcs_address
        cluster, job_id = Cluster(address), ray.get_runtime_context().get_job_id()
        before = cast(dict[str, Any], wait_for(lambda: live_row(cluster, job_id), timeout=120,
                                               what="the booted tree published"))
        assert before["incarnation"] == 1 and before["restarts"] == 0
        os.kill(int(before["info"]["pid"]), signal.SIGKILL)
        wait_for(lambda: (row := live_row(cluster, job_id)) and row["incarnation"] >= 2
                 and row["status"] == "running", timeout=90, interval=0.2,
                 what="the restarted engine published")
        after = cli_row(address)  # what a user on this machine sees
        assert after["restarts"] >= 1 and after["incarnation"] >= 2, after
        (entry,) = cluster.jobs()  # the run's identity, in Ray's job metadata
        assert (entry.name, entry.run_id, entry.config) == (
            cfg.run.name, job.run_dir.path.name, str(job.run_dir.config))
        # The restart adopted the warm spare (engine.spares), whose Ray name and Repr it
        # keeps, or, had the spare not been ready, built an actor under the engine's name.
        actor = after["info"]["actor_name"]
        if actor == ENGINE:
            assert engine_repr() == f"{ENGINE} running inc={after['incarnation']}"
        else:
            assert actor.startswith("erlay/generation/spare-"), actor
            assert engine_repr(actor) == \
                f"{actor} built as a spare (erlay status: the child it serves)"
        assert after["status"] == "running" and after["last_exit"].startswith("error")
        assert after["info"]["pid"] != before["info"]["pid"]
        text = erlay_status("--address", address)
        assert text.returncode == 0, text.stderr
        for node in ("erlay [one_for_one]", "generation [one_for_one]", "engine-0",
                     "engine-1", "learner-0", "rollout [rest_for_one]", "coordinator"):
            assert node in text.stdout, (node, text.stdout)
        assert f"run {job.run_dir.path.name}" in text.stdout
    finally:
        if job.tree is not None and job.tree.alive:  # stop the job long before its last step
            job.tree.run(job.tree.root.shutdown, timeout=120)  # type: ignore[union-attr]
        runner.join(timeout=120)
    # Stopped early, it trained fewer steps than configured: an honest failure, not "finished".
    assert results and results[0].status == "failed", results
    assert "of 100000 steps" in results[0].reason

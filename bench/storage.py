"""What a crash of the head costs a run on an object store, measured: ``run.storage=s3://...``
on a real S3 API server (moto's, on loopback; ``tests/s3server.py``), at the shipped upload
interval (``run.upload_every_s`` 5 s) unless ``--every`` says otherwise.

Each trial starts ``erlay run`` (the built-in model's arithmetic job) with its run directory in
the bucket, SIGKILLs the driver (and so the whole local Ray: the head is gone) once a
random RL step between ``--kill-after`` and ``steps - 2`` is reported, and compares what the
machine held at that instant with what the bucket held:

- ``journal_records_lost``: rollout-journal records in the local copy minus those the bucket's
  copy recovers (both read by the journal's own recovery);
- ``metrics_lines_lost``: ``metrics.jsonl`` lines, local minus remote;
- ``upload_age_s``: the kill minus the bucket's newest journal upload (how stale the remote
  was);
- ``steps_retrained``: the steps trained before the kill that the resume trains again (the last
  trained step + 1 minus the checkpoint it restores), and ``steps_retrained_extra``: those a
  resume from the local disk would not have (newest local checkpoint minus the remote one);

then resumes it with ``erlay run --resume s3://...`` on a fresh staging directory (the head's
disk is not used) and measures ``fetch_and_resume_s`` (the command's start to its first new
RL step, from its log) and whether the run finished and ``erlay verify s3://...`` passed.

Prints a table, then one JSON line: each figure as ``{"median", "min", "max", "runs"}`` over
the trials, ``resumed_ok`` and ``verified_ok`` (every trial), the settings and the load.

    python bench/storage.py [--trials 3] [--steps 12] [--every 5] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # tests.s3server, and bench.runstats as a package import
from bench.runstats import spread  # noqa: E402
from erlay.actors.journal.store import Journal  # noqa: E402
from erlay.actors.learner.checkpoint.format import latest  # noqa: E402
from erlay.actors.rundir import RunDir  # noqa: E402
from erlay.actors.storage.fetch import fetch_run, manifests, usable_checkpoints  # noqa: E402
from erlay.actors.storage.remote import Remote, open_remote  # noqa: E402
from tests.s3server import S3, aws_env, s3_server  # noqa: E402 - after the path

CONFIG = ROOT / "configs" / "cpu-builtin.yaml"
SMALL = ["warm_start.steps=30", "rollout.prompts_per_step=8", "rollout.group_size=4",
         "checkpoint.every_steps=3", "ray.num_cpus=4", "learner.lr_decay_steps=0"]


def erlay(args: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "erlay.supervisor.cli", *args], cwd=ROOT,
                            env=env, text=True, **kw)


def journal_records(directory: Path) -> int:
    with Journal.open(directory, read_only=True) as journal:
        return int(journal.state.applied)


def restorable(remote: Remote) -> bool:
    """Whether the bucket holds a checkpoint a resume can restore."""
    listing = remote.listing()
    return bool(usable_checkpoints(listing, manifests(remote, listing), with_journal=True))


def lines(path: Path) -> int:
    return path.read_text(encoding="utf-8").count("\n") if path.exists() else 0


def trial(s3: S3, work: Path, run_args: list[str], every: float, kill_at: int,
          checkpointed: bool = False) -> dict[str, Any]:
    """One trial (module docstring): ``erlay run *run_args`` on ``s3``, its driver killed
    once step ``kill_at`` is reported (and, with ``checkpointed``, once the bucket also holds
    a checkpoint a resume can restore), measured, resumed and verified.  The figures, with
    the run's ``url``."""
    env = {**os.environ, **s3.env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    head, runs = work / "head", s3.url("runs")
    killed = erlay(["run", *run_args, "--no-progress", f"run.storage={runs}",
                    f"run.staging={head}", f"run.upload_every_s={every}"], env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   start_new_session=True)
    deadline = time.monotonic() + 600
    local: Path | None = None
    try:
        while time.monotonic() < deadline and killed.poll() is None:
            local = next(head.glob("arithmetic-*"), None)
            done = RunDir(local).rl_steps() if local is not None else []
            if done and done[-1]["step"] >= kill_at and (
                    not checkpointed or restorable(open_remote(f"{runs}/{local.name}"))):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"the run never reached step {kill_at}")
        os.kill(killed.pid, signal.SIGKILL)
        killed_at = time.time()
        killed.wait(timeout=30)
    finally:
        try:
            os.killpg(killed.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert local is not None
    time.sleep(1.0)   # let the fate-shared Ray processes die before the disk is read
    url = f"{runs}/{local.name}"
    remote_copy = work / "remote-copy"
    fetch_run(open_remote(url), remote_copy, checkpoint="none")
    listing = open_remote(url).listing("journal")
    last_trained = RunDir(local).rl_steps()[-1]["step"]
    local_ckpt = latest(local / "checkpoints")
    figures: dict[str, Any] = {
        "url": url, "kill_after_step": last_trained,
        "journal_records_lost": journal_records(local / "journal")
        - journal_records(remote_copy / "journal"),
        "metrics_lines_lost": lines(local / "metrics.jsonl")
        - lines(remote_copy / "metrics.jsonl")}
    mtimes = [i.mtime.timestamp() for i in open_remote(url).fs.get_file_info(
        [f"{open_remote(url).root}/{rel}" for rel in listing]) if i.mtime is not None]
    figures["upload_age_s"] = round(killed_at - max(mtimes), 2) if mtimes else None
    shutil.rmtree(head)   # the head machine and its disk are gone

    started = time.time()
    resumed = erlay(["run", "--resume", url, f"run.staging={work / 'new-head'}",
                     "--no-progress"], env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = resumed.communicate(timeout=900)
    restored = re.search(r"resuming from the checkpoint of step (\d+)", out)
    step0 = int(restored.group(1)) if restored else 0
    figures["steps_retrained"] = last_trained + 1 - step0
    figures["steps_retrained_extra"] = (local_ckpt.step if local_ckpt else 0) - step0
    # The log's clock is the local time, to the millisecond.
    first = re.search(r"^(\S+ \S+),(\d{3}) INFO erlay\.progress: step", err, re.MULTILINE)
    figures["fetch_and_resume_s"] = round(
        time.mktime(time.strptime(first.group(1), "%Y-%m-%d %H:%M:%S"))
        + int(first.group(2)) / 1000 - started, 1) if first else None
    figures["resumed_ok"] = resumed.returncode == 0
    verify = subprocess.run([sys.executable, "-m", "erlay.supervisor.cli", "verify", url],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    figures["verified_ok"] = verify.returncode == 0
    if not (figures["resumed_ok"] and figures["verified_ok"]):
        print(err[-3000:] + verify.stdout[-3000:], file=sys.stderr)
    return figures


FIGURES = [
    ("journal_records_lost", "journal records on the head, not in the bucket, at the kill"),
    ("metrics_lines_lost", "metrics.jsonl lines on the head, not in the bucket"),
    ("upload_age_s", "kill - the bucket's newest journal upload (s)"),
    ("steps_retrained", "steps trained before the kill that the resume trains again"),
    ("steps_retrained_extra", "of those, more than a resume from the head's disk would"),
    ("fetch_and_resume_s", "erlay run --resume s3://... -> its first new RL step (s)"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=float, default=5.0, help="run.upload_every_s")
    parser.add_argument("--kill-after", type=int, default=4, help="the earliest RL step "
                        "after which the driver is killed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="CI's smallest run: 1 trial, "
                        "6 steps, killed after step 3")
    args = parser.parse_args()
    if args.smoke:
        args.trials, args.steps, args.kill_after = 1, 6, 3
    rng = random.Random(args.seed)
    load0 = os.getloadavg()[0]
    began = time.monotonic()
    trials = []
    with s3_server() as s3, aws_env(s3):
        for i in range(args.trials):
            work = Path(tempfile.mkdtemp(prefix=f"erlay-bench-storage-{i}-"))
            try:
                kill_at = rng.randint(args.kill_after, max(args.kill_after, args.steps - 3))
                trials.append(trial(s3, work, [str(CONFIG), *SMALL, f"run.steps={args.steps}"],
                                    args.every, kill_at))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {}
    print(f"a crash of the head on s3 (moto, loopback): {args.trials} trial(s), "
          f"{args.steps} steps, run.upload_every_s {args.every}, checkpoint every 3 steps")
    print(f"{'figure':24} {'median (min-max)':>22}  what it measures")
    for key, what in FIGURES:
        values = [t[key] for t in trials if t[key] is not None]
        out[key] = spread(values, digits=2) if values else None
        cell = (f"{out[key]['median']:g} ({out[key]['min']:g}-{out[key]['max']:g})"
                if values else "n/a")
        print(f"{key:24} {cell:>22}  {what}")
    out.update({"kill_after_steps": [t["kill_after_step"] for t in trials],
                "resumed_ok": all(t["resumed_ok"] for t in trials),
                "verified_ok": all(t["verified_ok"] for t in trials),
                "trials": args.trials, "steps": args.steps, "upload_every_s": args.every,
                "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
                "wall_s": round(time.monotonic() - began, 1)})
    print(json.dumps(out))
    if not (out["resumed_ok"] and out["verified_ok"]):
        print("storage: a resumed run did not finish, or did not verify", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

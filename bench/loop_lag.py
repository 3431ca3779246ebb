"""Benchmark: how late the supervision loop's timers fire during the default CPU job, and
while an environment freezes its process holding the GIL.

Prints a table, then one JSON object as the last line.

    python bench/loop_lag.py [--runs 3] [--steps 40] [--freeze-s 20] [override ...]
    python bench/loop_lag.py --plant-in-driver      # must fail: see below
    python bench/loop_lag.py --quick                # 1 run of each, 3 steps (the tests' size)
    python bench/loop_lag.py --smoke                # CI's smoke size: 1 frozen_env run

``--smoke`` runs the frozen_env job alone, at the ``--quick`` size with no warm start and a
2 s freeze against a 1 s environment-call deadline.  The default run is the same job and
probe without the freeze: the smoke leaves out its figures (``loop_lag_p99_ms``,
``loop_lag_max_ms``), not any of the bench's code, and takes half the time.

What it measures.  The supervision tree's event loop (``SupervisionTree.loop``, where every
supervisor decides, judges heartbeats and restarts children) gets a probe once the tree is
up: a timer due every 10 ms on a fixed schedule, recording how late each due time is
served (``loop.time()`` at the wake-up minus the time it was due).  A stall of the loop
records every timer it held up, not just the one that was waiting (otherwise a 20 s stall
would be one sample among thousands, and a percentile would not see it).  The probe runs
from the tree's start to the job's end, warm start included.  ``loop_lag_p99_ms`` is a
run's 99th percentile, the figure the median, min and max are taken over;
``loop_lag_max_ms`` is each run's worst.

- **default**: ``configs/cpu.yaml`` as shipped, but ``run.steps=--steps`` (600 steps would
  be 5 minutes a run, with nothing new after the first few).
- **frozen_env**: the same job, and once its first RL step is reported, the environment's
  code freezes its process holding the GIL for ``--freeze-s`` (the ``environment.call``
  failpoint's ``freeze`` action, armed once in each environment worker process through its
  host: the user's catastrophic regex).  The freeze must land: a run whose metrics show no
  environment call that timed out fails, since it measured nothing.

Planted violation.  ``--plant-in-driver`` freezes a thread of the *driver* for
``--freeze-s`` instead, as erlay's environments did when they ran on the driver's threads:
the probe must then see the supervision loop stop, and the benchmark exits 1 naming the
figure.  A probe that never fired, or fired too rarely to cover the run, fails too.

``load_avg`` is the machine's 1/5/15-minute load average at the end: the load the figures
were measured under.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from erlay.actors.config import load_config
from erlay.actors.job.driver import Job
from erlay.actors.rundir import RunDir
from erlay.supervisor.failpoints import hold_gil
from erlay.supervisor.raylocal import shutdown_ray
from erlay.supervisor.tree import SupervisionTree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runstats import spread  # bench/ (a script's own folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
PERIOD_S = 0.010
TARGET_MS = 50.0
# --smoke: no warm start, and a 1 s call deadline that the 2 s freeze outlasts.  The
# rollouts keep their shipped size: at 4 x 2 a step the run's environment calls were over
# before the first RL step was reported, and the freeze, armed then, never landed.
SMOKE_OVERRIDES = ["warm_start.steps=0", "plugins.timeout_s=1"]


@dataclass
class Probe:
    """A timer due every ``PERIOD_S`` on a loop, on a fixed schedule (the ``k``-th is due
    ``k x PERIOD_S`` after the start).  ``lags_ms`` holds how late each due time was served:
    a wake-up at ``now`` serves every due time up to ``now``, so a loop that stalls for a
    second records the hundred timers it missed (lags 1000, 990, ... ms), not one late timer
    (the coordinated omission that would hide a stall from a percentile).  ``fires`` counts
    the wake-ups themselves, the evidence that the probe ran."""

    lags_ms: list[float] = field(default_factory=list)
    fires: int = 0
    started: float = 0.0
    stopped: float = 0.0
    _task: Any = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        async def tick() -> None:
            self.started = loop.time()
            k = 1
            while True:
                await asyncio.sleep(max(0.0, self.started + k * PERIOD_S - loop.time()))
                now = loop.time()
                self.fires += 1
                while self.started + k * PERIOD_S <= now:
                    self.lags_ms.append((now - self.started - k * PERIOD_S) * 1000)
                    k += 1
                self.stopped = now

        def schedule() -> None:
            self._task = loop.create_task(tick(), name="loop-lag-probe")
        loop.call_soon_threadsafe(schedule)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.lags_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def first_rl_step(job: Job, timeout_s: float = 300.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if job.last_rl_metrics is not None:
            return True
        time.sleep(0.1)
    return False


def arm_freeze(tree: SupervisionTree, job: Job, freeze_s: float) -> None:
    """Freeze each environment worker process once, on its next call."""
    import ray
    assert job.paths is not None
    spec = {"action": "freeze", "delay_s": freeze_s, "count": 1}
    for host in job.paths.environment_hosts:
        ray.get(tree.ref(host).actor._erlay_failpoints.remote("arm", "environment.call", spec),
                timeout=30)


def run_once(mode: str, args: argparse.Namespace, parent: Path, n: int) -> dict[str, Any]:
    """One job with the probe; ``mode`` is ``default``, ``frozen_env`` or ``planted``."""
    overrides = [f"run.steps={args.steps}", f"run.storage={parent}", *args.overrides]
    if args.smoke:
        overrides += SMOKE_OVERRIDES
    elif args.quick:
        overrides += ["warm_start.steps=5", "plugins.timeout_s=3"]
    cfg = load_config(Path(args.config), overrides)
    job = Job(cfg, RunDir.create(parent, f"{mode}-{n}"))
    probe = Probe()
    faults: list[str] = []

    def on_start(tree: SupervisionTree) -> None:
        probe.start(tree.loop)
        if mode == "default":
            return

        def fault() -> None:
            if not first_rl_step(job):
                faults.append("no RL step was reported: nothing frozen")
                return
            if mode == "frozen_env":
                arm_freeze(tree, job, args.freeze_s)
            else:   # planted: user code on a driver thread, as before issue 34
                hold_gil(args.freeze_s)
            faults.append(mode)
        threading.Thread(target=fault, name="loop-lag-fault", daemon=True).start()

    import ray
    owned = not ray.is_initialized()   # a Ray this run starts ends with it
    result = job.run(progress=False, on_start=on_start)
    if owned:
        shutdown_ray()
    if result.status != "finished":
        raise SystemExit(f"{mode} run {n}: the job {result.status}: {result.reason}")
    covered = probe.stopped - probe.started
    if not probe.lags_ms or probe.fires < 0.25 * covered / PERIOD_S:
        raise SystemExit(f"{mode} run {n}: the probe fired {probe.fires} times over "
                         f"{covered:.1f} s: it did not cover the run (no evidence)")
    timeouts = sum(int(m.get("user_errors", 0)) for m in job.run_dir.rl_steps())
    if mode == "frozen_env" and (faults != ["frozen_env"] or timeouts == 0):
        raise SystemExit(f"frozen_env run {n}: the freeze did not land ({faults or 'not '}"
                         f"armed, {timeouts} environment call(s) failed): no evidence")
    return {"p99_ms": probe.percentile(0.99), "max_ms": max(probe.lags_ms),
            "ticks": len(probe.lags_ms), "fires": probe.fires, "covered_s": round(covered, 1),
            "env_failures": timeouts, "wall_s": round(result.wall_s, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "configs" / "cpu.yaml"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--freeze-s", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="1 run of each, 3 RL steps")
    parser.add_argument("--smoke", action="store_true",
                        help="CI's smoke size: one frozen_env run, smaller than --quick")
    parser.add_argument("--plant-in-driver", action="store_true",
                        help="freeze a driver thread instead: the run must fail")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.quick or args.smoke:
        args.runs, args.steps, args.freeze_s = 1, 3, (2.0 if args.smoke else 4.0)
    logging.getLogger("erlay").setLevel(logging.ERROR)
    parent = Path(tempfile.mkdtemp(prefix="erlay-looplag-"))
    modes = ["planted"] if args.plant_in_driver else \
        ["frozen_env"] if args.smoke else ["default", "frozen_env"]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for n in range(args.runs):   # interleaved, so drift in the machine's speed hits both
        for mode in modes:
            runs[mode].append(run_once(mode, args, parent, n))
    key = {"default": "loop_lag_p99_ms", "frozen_env": "loop_lag_p99_ms_frozen_env",
           "planted": "loop_lag_p99_ms_planted_driver_freeze"}
    out: dict[str, Any] = {}
    print(f"{'figure':40s} {'median':>8s} {'min':>8s} {'max':>8s}  runs  target")
    for mode, results in runs.items():
        p99 = spread([r["p99_ms"] for r in results], digits=2)
        worst = spread([r["max_ms"] for r in results], digits=1)
        out[key[mode]] = p99
        out[key[mode].replace("p99", "max")] = worst
        print(f"{key[mode]:40s} {p99['median']:8.2f} {p99['min']:8.2f} {p99['max']:8.2f}  "
              f"{p99['runs']:4d}  <= {TARGET_MS:g}")
        print(f"{key[mode].replace('p99', 'max'):40s} {worst['median']:8.1f} "
              f"{worst['min']:8.1f} {worst['max']:8.1f}  {worst['runs']:4d}")
    out["runs"] = runs
    out["steps"], out["freeze_s"], out["period_ms"] = args.steps, args.freeze_s, PERIOD_S * 1e3
    out["target_ms"] = TARGET_MS
    out["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))
    if args.plant_in_driver:
        planted = out[key["planted"]]["max"]
        if planted <= TARGET_MS:
            raise SystemExit(f"planted driver freeze not caught: {key['planted']} "
                             f"{planted} <= {TARGET_MS:g} ms")
        raise SystemExit(f"{key['planted']}: {planted} ms > {TARGET_MS:g} ms: the supervision "
                         f"loop stopped while the driver's thread held the GIL (as planted)")


if __name__ == "__main__":
    main()

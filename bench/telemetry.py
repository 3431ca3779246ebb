"""Benchmark: what telemetry costs, in CPU seconds per trained sample and in wall time.

Prints a table, then one JSON object as the last line.

    python bench/telemetry.py [--pairs 6] [--config configs/cpu.yaml] [override ...]
    python bench/telemetry.py --smoke   # one pair of two-step jobs (CI)

Runs short jobs of the CPU default (60 warm-start steps, then 60 RL steps) with telemetry off
(``telemetry.exporter=none``, ``telemetry.ray_metrics=false``) and on (the shipped default:
spans and metrics to files, Ray metrics, 2% of rollouts traced end to end), in pairs whose
order alternates (off then on, on then off, ...), so a drift of the machine over the run
(page cache, a neighbour's load) falls on both sides alike.

While each job runs, a sampler *process* (so its own work is not counted) reads every
process's CPU time (user + system, ``psutil``) every ``SAMPLE_S`` seconds and tags it with its
role from the process title: ``driver`` (this process, which runs the job and its
coordinator), a Ray actor by its class (``ray::TorchEngine`` -> ``TorchEngine``: the engines,
the ``Learner``, the sandbox, judge and environment hosts), ``children`` (processes those actors
spawned: sandbox workers, environment workers), and Ray's own (``raylet``, ``gcs_server``,
its agents, idle pooled workers), which is reported apart and left out of the figure.

``telemetry_cpu_overhead`` is, per pair, (job CPU seconds per trained sample, on) / (the same,
off); the median over pairs with its spread.  The CPU is counted over the RL window only
(the first RL step's start to the last RL step's report, from ``metrics.jsonl``), each
process's cumulative CPU time interpolated to the window's edges, so start-up (Ray, imports,
the warm start) does not dilute the ratio and no process's end is missed (every job process
is alive through the window).  ``telemetry_overhead`` is the wall-clock ratio as
``bench/learning.py`` has always measured it: RL samples/s off / on, median over pairs.

A job whose window holds no CPU of the driver, of an engine or of the learner raises
:class:`Unmeasured`: a sampler that saw nothing must not report a ratio of 1.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runstats import spread

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_S = 0.25
OVERHEAD_OVERRIDES = ["run.steps=60", "warm_start.steps=60", "learner.lr_decay_steps=0"]
SMOKE_OVERRIDES = ["run.steps=4", "warm_start.steps=1", "rollout.prompts_per_step=2",
                   "rollout.group_size=2", "learner.lr_decay_steps=0",
                   "environment.workers_per_node=1"]
TELEMETRY_OFF = ["telemetry.exporter=none", "telemetry.ray_metrics=false"]
RAY_OWN = ("raylet", "gcs_server", "ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent",
           "dashboard.py", "log_monitor.py", "monitor.py", "agent.py", "ray_client_server")
NEEDED = ("driver", "Learner", "*Engine")
"""Roles whose CPU a measured job's window must hold (see :class:`Unmeasured`); ``*Engine``
is any engine class (``TorchEngine``, ``VLLMEngine``)."""


class Unmeasured(RuntimeError):
    """The sampler's records cannot support a figure (a needed role has no CPU in the
    window, or the job has no RL step)."""


# ---------------------------------------------------------------------- the sampler process
def role_of(title: str, pid: int, driver: int, ancestors: set[int]) -> str | None:
    """The role of a process from its title (``cmdline`` joined; a spare engine is ``TorchEngine
    (spare)``): see the module docstring.
    ``ancestors``: pids of the job's actor processes; a process below one is ``children``.
    None for a process that is not the job's nor Ray's (the editor, the sampler)."""
    if pid == driver:
        return "driver"
    if any(own in title for own in RAY_OWN):
        return "ray"
    if title.startswith("ray::"):
        # ``ray::Class.method``, or ``ray::NAME:Class`` for a named actor (a spare engine).
        name, _, cls = title[5:].split(" ", 1)[0].rpartition(":")
        cls = cls.split(".", 1)[0] or "ray"
        return f"{cls} (spare)" if "spare" in name else cls
    if ancestors:
        return "children"
    return None


def sample_forever(driver: int, out: Path, interval_s: float) -> None:
    """Append one JSON line per sample to ``out``: ``{"t": wall time, "cpu": {pid: [role,
    cpu_s]}}``, until SIGTERM."""
    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True
    signal.signal(signal.SIGTERM, on_term)
    me = os.getpid()
    with out.open("a", encoding="utf-8") as f:
        while not stop:
            t = time.time()
            procs: dict[int, tuple[str, int, float]] = {}
            for p in psutil.process_iter(["pid", "ppid", "cmdline", "cpu_times"]):
                info = p.info
                if info["pid"] == me or info["cpu_times"] is None:
                    continue
                title = " ".join(info["cmdline"] or [])
                cpu = info["cpu_times"].user + info["cpu_times"].system
                procs[info["pid"]] = (title, info["ppid"], cpu)
            cpu_of: dict[str, list[Any]] = {}
            for pid, (title, ppid, cpu) in procs.items():
                ancestors, up = set(), ppid
                while up in procs and up not in ancestors and up != driver:
                    if procs[up][0].startswith("ray::") and not any(
                            own in procs[up][0] for own in RAY_OWN):
                        ancestors.add(up)
                    up = procs[up][1]
                role = role_of(title, pid, driver, ancestors)
                if role is not None:
                    cpu_of[str(pid)] = [role, round(cpu, 3)]
            f.write(json.dumps({"t": round(t, 3), "cpu": cpu_of}) + "\n")
            f.flush()
            time.sleep(max(0.0, interval_s - (time.time() - t)))


# ---------------------------------------------------------------------- pure figures
def cpu_at(series: list[tuple[float, float]], t: float) -> float:
    """A process's cumulative CPU seconds at wall time ``t``, linear between samples
    (``series``: (time, cpu) sorted by time); 0 before it was first seen, its last value
    after it was last seen."""
    if not series or t <= series[0][0]:
        return 0.0 if not series or t < series[0][0] else series[0][1]
    times = [s[0] for s in series]
    i = bisect.bisect_right(times, t)
    if i >= len(series):
        return series[-1][1]
    (t0, c0), (t1, c1) = series[i - 1], series[i]
    return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1


def cpu_by_role(samples: list[dict[str, Any]], start: float, end: float) -> dict[str, float]:
    """CPU seconds each role spent in ``[start, end]``, from the sampler's lines.  A pid's
    role is its last one seen (an idle pooled worker becomes an actor)."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    roles: dict[str, str] = {}
    for line in sorted(samples, key=lambda s: s["t"]):
        for pid, (role, cpu) in line["cpu"].items():
            series[pid].append((line["t"], cpu))
            roles[pid] = role
    out: dict[str, float] = defaultdict(float)
    for pid, points in series.items():
        if points[0][0] > end:
            continue   # born after the window
        if points[0][0] > start and points[0][1] > 0:
            # First seen inside the window: its CPU before the first sample is in the window
            # too (a process born in it), so count from 0 at its first sight.
            points = [(start, 0.0), *points]
        out[roles[pid]] += max(0.0, cpu_at(points, end) - cpu_at(points, start))
    return dict(out)


def job_cpu(by_role: dict[str, float]) -> float:
    """The job's CPU seconds: every role but Ray's own."""
    return sum(v for role, v in by_role.items() if role != "ray")


def rl_window(steps: list[dict[str, Any]]) -> tuple[float, float, int]:
    """(start, end, trained samples) of the RL steps' records: the first step's start to
    the last step's report, wall-clock seconds (a record's ``time`` counts from the job's
    ``started_at``)."""
    if not steps:
        raise Unmeasured("the job recorded no RL step")
    t0 = float(steps[0]["started_at"])
    start = t0 + steps[0]["time"] - steps[0]["step_s"]
    return start, t0 + steps[-1]["time"], sum(int(m["samples"]) for m in steps)


def check_measured(by_role: dict[str, float], needed: tuple[str, ...] = NEEDED) -> None:
    """Raise :class:`Unmeasured` unless every ``needed`` role spent CPU in the window."""
    def spent(role: str) -> bool:
        if role.startswith("*"):
            return any(v > 0 and r.endswith(role[1:]) for r, v in by_role.items())
        return by_role.get(role, 0.0) > 0.0
    missing = [role for role in needed if not spent(role)]
    if missing:
        raise Unmeasured(f"no CPU seen for {', '.join(missing)} in the RL window "
                         f"(roles seen: {sorted(by_role)})")


@dataclass(frozen=True)
class JobCost:
    """One job's figures: RL samples/s and CPU per trained sample, by role."""

    telemetry: bool
    samples_per_s: float
    cpu_per_sample: float                 # the job's, Ray's own apart
    by_role: dict[str, float]             # CPU seconds per role in the RL window
    samples: int


def measure(samples: list[dict[str, Any]], steps: list[dict[str, Any]],
            telemetry: bool) -> JobCost:
    start, end, trained = rl_window(steps)
    by_role = cpu_by_role(samples, start, end)
    check_measured(by_role)
    if trained <= 0:
        raise Unmeasured("the RL window trained no sample")
    return JobCost(telemetry, trained / (end - start), job_cpu(by_role) / trained,
                   {k: round(v, 3) for k, v in sorted(by_role.items())}, trained)


def pair_ratios(pairs: list[tuple[JobCost, JobCost]]) -> dict[str, Any]:
    """The figures of (off, on) pairs: wall and CPU ratios, and CPU per role on/off."""
    if not pairs:
        raise Unmeasured("no pair was run")
    wall = [off.samples_per_s / on.samples_per_s for off, on in pairs]
    cpu = [on.cpu_per_sample / off.cpu_per_sample for off, on in pairs]
    roles = sorted({r for off, on in pairs for r in (*off.by_role, *on.by_role)})
    per_role = {}
    for role in roles:
        extra = [(on.by_role.get(role, 0.0) / on.samples - off.by_role.get(role, 0.0)
                  / off.samples) * 1e6 for off, on in pairs]
        per_role[role] = spread(extra, digits=1)   # µs of CPU per trained sample, on - off
    return {"telemetry_overhead": spread(wall, digits=3),
            "telemetry_cpu_overhead": spread(cpu, digits=3),
            "telemetry_overhead_pairs": [round(r, 3) for r in wall],
            "telemetry_cpu_overhead_pairs": [round(r, 3) for r in cpu],
            "extra_cpu_us_per_sample_by_role": per_role,
            "cpu_ms_per_sample_off": spread([off.cpu_per_sample * 1e3 for off, _ in pairs],
                                            digits=3),
            "cpu_ms_per_sample_on": spread([on.cpu_per_sample * 1e3 for _, on in pairs],
                                           digits=3)}


# ---------------------------------------------------------------------- the profile
TELEMETRY_FILES = ("opentelemetry/", "supervisor/telemetry.py", "supervisor/otel.py",
                   "observe/telemetry.py", "observe/metrics.py", "ray/util/metrics.py")
"""A py-spy frame in one of these files is telemetry's work."""
WAITS = ("Event.wait ", "Condition.wait ", "Condition._is_owned ")


def telemetry_frame(frame: str) -> str | None:
    """``function (file)`` of a py-spy frame (``function (path:line)``) that is telemetry's
    work, else None."""
    if not any(f in frame for f in TELEMETRY_FILES):
        return None
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    return f"{name} ({'/'.join(path.split('/')[-2:])})"


def profile_costs(raw_by_role: dict[str, list[str]]) -> dict[str, Any]:
    """Where telemetry's samples are in ``py-spy record --format raw`` profiles, by role:
    its samples, telemetry's share of them, and the top telemetry entry points (the
    outermost telemetry frame of each stack) by samples.  Stacks under an import
    (``<module>``) are left out of both: an import is paid once, on or off alike.  So are
    stacks that end in a wait (``Event.wait``, ``Condition.wait``): py-spy counts a thread
    whose timed wait ended and that waits for the GIL as active, but it spends no CPU."""
    out = {}
    for role, raws in sorted(raw_by_role.items()):
        samples, spent = 0, defaultdict(int)
        for text in (t for raw in raws for t in raw.splitlines()):
            stack, _, count = text.rpartition(" ")
            if not stack or not count.isdigit() or "<module>" in stack:
                continue
            if stack.rsplit(";", 1)[-1].startswith(WAITS):
                continue
            samples += int(count)
            entry = next((t for t in map(telemetry_frame, stack.split(";")) if t), None)
            if entry is not None:
                spent[entry] += int(count)
        top = sorted(spent.items(), key=lambda kv: -kv[1])[:8]
        out[role] = {"samples": samples,
                     "telemetry_share": round(sum(spent.values()) / samples, 4) if samples
                     else 0.0, "top": dict(top)}
    return out


def _py_spy() -> str:
    exe = Path(sys.executable).parent / "py-spy"
    if exe.exists():
        return str(exe)
    if shutil.which("py-spy") is None:
        raise SystemExit("--profile needs py-spy: pip install -e '.[bench]'")
    return "py-spy"


def profile(config: Path, overrides: list[str], parent: Path) -> dict[str, Any]:
    """One telemetry-on job with a ``py-spy record`` on the driver and on each of the job's
    actor processes as it appears (``--subprocesses``: their children too);
    :func:`profile_costs` of them."""
    from learning import run_job
    exe, driver, spies = _py_spy(), os.getpid(), {}
    stop = threading.Event()

    def attach(pid: int, role: str) -> None:
        out = parent / f"profile-{role}-{pid}.txt"
        spies[pid] = (role, out, subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--subprocesses", "--format", "raw",
             "--rate", "200", "--nonblocking", "-o", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def watch() -> None:
        while not stop.wait(0.3):
            for p in psutil.process_iter(["pid", "cmdline"]):
                title = " ".join(p.info["cmdline"] or [])
                role = role_of(title, p.info["pid"], driver, set())
                if p.info["pid"] not in spies and role not in (None, "ray"):
                    attach(p.info["pid"], role)
    attach(driver, "driver")
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run_job(config, overrides, parent, "profile")
    finally:
        stop.set()
        watcher.join(timeout=10)
        for _, _, spy in spies.values():
            spy.send_signal(signal.SIGINT)   # py-spy writes what it has on SIGINT
        for _, _, spy in spies.values():
            spy.wait(timeout=60)
    raws: dict[str, list[str]] = defaultdict(list)
    for role, out, _ in spies.values():
        if out.exists():
            raws[role].append(out.read_text(encoding="utf-8", errors="replace"))
    if "driver" not in raws:
        raise Unmeasured(f"py-spy wrote no profile of the driver (in {parent})")
    return profile_costs(raws)


# ---------------------------------------------------------------------- running jobs
def run_measured(config: Path, overrides: list[str], parent: Path, name: str,
                 telemetry: bool, on: Sequence[str] = ()) -> tuple[JobCost, Path]:
    """Run one job with the sampler process watching: its :class:`JobCost` and its run
    directory.  ``on``: overrides of the telemetry-on job only (to isolate one part)."""
    from learning import run_job  # bench/learning.py: the job as the learning bench runs it
    out = parent / f"{name}.cpu.jsonl"
    sampler = subprocess.Popen([sys.executable, __file__, "--sampler", str(os.getpid()),
                                str(out), str(SAMPLE_S)])
    try:
        _, run_dir = run_job(config, [*overrides, *(on if telemetry else TELEMETRY_OFF)],
                             parent, name)
    finally:
        sampler.terminate()
        sampler.wait(timeout=30)
    lines = [json.loads(s) for s in out.read_text(encoding="utf-8").splitlines() if s]
    return measure(lines, run_dir.rl_steps(), telemetry), run_dir.path


def run_pairs(config: Path, overrides: list[str], parent: Path, pairs: int,
              on: Sequence[str] = ()) -> tuple[list[tuple[JobCost, JobCost]], int]:
    """``pairs`` off/on pairs, the order alternating; and the spans the last on-job wrote."""
    done: list[tuple[JobCost, JobCost]] = []
    spans = 0
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        costs = {}
        for tel in order:
            name = f"{'on' if tel else 'off'}-{i}"
            costs[tel], path = run_measured(config, overrides, parent, name, tel, on)
            print(f"pair {i} {name}: {costs[tel].samples_per_s:.1f} samples/s, "
                  f"{costs[tel].cpu_per_sample * 1e3:.3f} ms CPU/sample", file=sys.stderr)
            if tel:
                spans = sum(1 for f in (path / "telemetry").glob("spans-*.jsonl")
                            for _ in f.open(encoding="utf-8"))
        done.append((costs[False], costs[True]))
    return done, spans


def telemetry_figures(config: Path, overrides: list[str], parent: Path, pairs: int,
                      on: Sequence[str] = ()) -> dict[str, Any]:
    """What ``bench/learning.py`` reports too: the pair figures and the spans of a job."""
    done, spans = run_pairs(config, overrides, parent, pairs, on)
    return {**pair_ratios(done), "telemetry_spans_per_job": spans}


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--sampler":
        sample_forever(int(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "configs" / "cpu.yaml"))
    parser.add_argument("--pairs", type=int, default=6, help="off/on job pairs (order alternates)")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size (CI): one pair of three-step jobs")
    parser.add_argument("--on", action="append", default=[], metavar="OVERRIDE",
                        help="an override of the telemetry-on jobs only, to isolate one part "
                        "(e.g. --on telemetry.ray_metrics=false)")
    parser.add_argument("--profile", action="store_true",
                        help="instead: one telemetry-on job under py-spy, telemetry's top costs "
                        "per process")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = [*OVERHEAD_OVERRIDES, *args.overrides]
    if args.profile:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        logging.getLogger("erlay").setLevel(logging.ERROR)
        costs = profile(Path(args.config), overrides,
                        Path(tempfile.mkdtemp(prefix="erlay-bench-profile-")))
        for role, c in costs.items():
            print(f"{role}: {c['samples']} samples, telemetry {c['telemetry_share']:.2%}")
            for entry, n in c["top"].items():
                print(f"    {n:6d}  {entry}")
        print(json.dumps({"profile": costs}))
        return
    if args.smoke:
        args.pairs, overrides = 1, [*SMOKE_OVERRIDES, *args.overrides]
    logging.getLogger("erlay").setLevel(logging.ERROR)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    parent = Path(tempfile.mkdtemp(prefix="erlay-bench-telemetry-"))
    began = time.time()
    out = telemetry_figures(Path(args.config), overrides, parent, args.pairs, args.on)
    out.update(pairs=args.pairs, on_overrides=args.on, smoke=args.smoke,
               wall_s=round(time.time() - began, 1),
               load_avg_at_end=[round(x, 2) for x in os.getloadavg()])
    targets = {"telemetry_overhead": "<= 1.03 (median)",
               "telemetry_cpu_overhead": "<= 1.03 (median)"}
    print(f"{'figure':34s} {'measured':>44s}  target")
    for key, value in out.items():
        if key != "extra_cpu_us_per_sample_by_role":
            print(f"{key:34s} {json.dumps(value):>44s}  {targets.get(key, '')}")
    for role, s in out["extra_cpu_us_per_sample_by_role"].items():
        print(f"  extra CPU µs/sample, {role:22s} {json.dumps(s)}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
